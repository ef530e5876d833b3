"""The model store in Ollama's layout: names (tables from Ollama's types/model/name_test.go), digests and
blobs (the /api/blobs checks), manifests byte for byte, list/show/create/copy/delete, Modelfiles."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import time
from pathlib import Path

import pytest

from ollama_engine.store import (
    BadRequest,
    DigestMismatch,
    InvalidDigest,
    InvalidName,
    ModelfileError,
    ModelNotFound,
    Name,
    ParameterError,
    Store,
    StoreError,
    check_digest,
    file_digest,
    format_param,
    human_number,
    parameter_lines,
    parse_modelfile,
    parse_name,
    parse_name_bare,
)
from ollama_engine.store.disk import Manifest
from ollama_engine.store.names import is_valid_namespace, is_valid_part, name_from_parts
from ollama_engine.store.store import file_type_name
from ollama_engine.template.gojson import Float32

PART80 = "8" * 80
PART350 = "3" * 350


# ---- names: TestParseNameParts ------------------------------------------------------------------


@pytest.mark.parametrize(("text", "bare", "path"), [
    ("registry.ollama.ai/library/dolphin-mistral:7b-v2.6-dpo-laser-q6_K",
     Name("registry.ollama.ai", "library", "dolphin-mistral", "7b-v2.6-dpo-laser-q6_K"),
     ("registry.ollama.ai", "library", "dolphin-mistral", "7b-v2.6-dpo-laser-q6_K")),
    ("scheme://host:port/namespace/model:tag", Name("host:port", "namespace", "model", "tag", "scheme"),
     ("host:port", "namespace", "model", "tag")),
    ("host/namespace/model:tag", Name("host", "namespace", "model", "tag"), ("host", "namespace", "model", "tag")),
    ("host:port/namespace/model:tag", Name("host:port", "namespace", "model", "tag"),
     ("host:port", "namespace", "model", "tag")),
    ("host/namespace/model", Name("host", "namespace", "model"), ("host", "namespace", "model", "latest")),
    ("host:port/namespace/model", Name("host:port", "namespace", "model"),
     ("host:port", "namespace", "model", "latest")),
    ("namespace/model", Name("", "namespace", "model"), ("registry.ollama.ai", "namespace", "model", "latest")),
    ("model", Name("", "", "model"), ("registry.ollama.ai", "library", "model", "latest")),
    ("h/nn/mm:t", Name("h", "nn", "mm", "t"), ("h", "nn", "mm", "t")),
    (f"{PART80}/{PART80}/{PART80}:{PART80}", Name(PART80, PART80, PART80, PART80), (PART80,) * 4),
    (f"{PART350}/{PART80}/{PART80}:{PART80}", Name(PART350, PART80, PART80, PART80), (PART350,) + (PART80,) * 3),
])
def test_parse_name_parts(text: str, bare: Name, path: tuple[str, ...]) -> None:
    assert parse_name_bare(text) == bare
    assert parse_name(text).parts() == path


# TestNameIsValid's table: name -> valid (without defaults).
VALIDITY = {
    "": False, "_why/_the/_lucky:_stiff": True, "h/n/m:t": True, "host/namespace/model:tag": True,
    "host/namespace/model": False, "namespace/model": False, "model": False,
    f"{PART80}/{PART80}/{PART80}:{PART80}": True, f"{PART350}/{PART80}/{PART80}:{PART80}": True,
    "h/nn/mm:t": True, "m": False, "n/m:": False, "h/n/m": False, "@t": False, "m@d": False,
    "^": False, "mm:": False, "/nn/mm": False, "//": False, "//mm": False, "hh//": False, "//mm:@": False,
    "00@": False, "@": False, "-hh/nn/mm:tt": False, "hh/-nn/mm:tt": False, "hh/nn/-mm:tt": False,
    "hh/nn/mm:-tt": False, "host:https/namespace/model:tag": True, "host/name:space/model:tag": False,
}


@pytest.mark.parametrize(("text", "valid"), sorted(VALIDITY.items()))
def test_name_is_valid(text: str, valid: bool) -> None:
    name = parse_name_bare(text)
    assert name.is_valid() is valid
    if valid:
        assert str(name) == text  # round trip


def test_default_name() -> None:
    assert str(parse_name("xx")) == "registry.ollama.ai/library/xx:latest"


@pytest.mark.parametrize(("kind", "part", "valid"), [
    ("host", "", False), ("host", "a", True), ("host", "a.", True), ("host", "a.b", True), ("host", "a:123", True),
    ("host", "a:123/aa/bb", False), ("namespace", "bb", True), ("namespace", "a.", False), ("model", "-h", False),
    ("digest", "sha256-1000000000000000000000000000000000000000000000000000000000000000", True),
    ("model", "a" * 81, False), ("host", "a" * 351, False), ("tag", "..", False), ("model", "..", False),
    ("model", "a/b", False), ("tag", "a\\b", False), ("model", "é", False), ("model", "a b", False),
])
def test_is_valid_part(kind: str, part: str, valid: bool) -> None:
    assert is_valid_part(kind, part) is valid


@pytest.mark.parametrize(("parts", "expected"), [
    (("host", "namespace", "model", "tag"), Name("host", "namespace", "model", "tag")),
    (("host:port", "namespace", "model", "tag"), Name("host:port", "namespace", "model", "tag")),
    (("namespace", "model", "tag"), None), (("model", "tag"), None), (("model",), None),
    (("..", "..", "model", "tag"), None), (("", "namespace", ".", "tag"), None), ((".", ".", ".", "."), None),
    (("/", "path", "to", "random", "file"), None),
])
def test_name_from_manifest_path(parts: tuple[str, ...], expected: Name | None) -> None:
    assert name_from_parts(parts) == expected


@pytest.mark.parametrize(("text", "shortest"), [
    ("registry.ollama.ai/library/model:latest", "model:latest"),
    ("registry.ollama.ai/library/model:tag", "model:tag"),
    ("registry.ollama.ai/namespace/model:tag", "namespace/model:tag"),
    ("host/namespace/model:tag", "host/namespace/model:tag"),
    ("host/library/model:tag", "host/library/model:tag"),
])
def test_display_shortest(text: str, shortest: str) -> None:
    assert parse_name_bare(text).display_shortest() == shortest


@pytest.mark.parametrize(("text", "valid"), [
    ("", False), ("a", True), ("a:b", False), ("a/b", False), ("a:b/c", False), ("a/b:c", False),
    ("a/b:c/d", False), ("a/b:c/d@e", False), ("a/b:c/d@sha256-100", False), ("himynameisjoe", True),
    ("himynameisreallyreallyreallyreallylongbutitshouldstillbevalid", True),
])
def test_is_valid_namespace(text: str, valid: bool) -> None:
    assert is_valid_namespace(text) is valid


@pytest.mark.parametrize("text", ["../../etc/passwd", "..", "a/../../b:c", "../x", "x/..:y", "a:../b", "~/x",
                                  "/abs/path/model:tag", "a/b/c/d:e", "model:..", "model:a/b", "%2e%2e/x"])
def test_no_name_escapes_the_manifests_folder(tmp_path: Path, text: str) -> None:
    name = parse_name(text)
    if name.is_valid():  # then every part is a plain folder name
        path = Store(tmp_path).manifest_path(name).resolve()
        assert path.is_relative_to((tmp_path / "manifests").resolve()) and ".." not in name.parts()
    else:
        with pytest.raises(InvalidName):
            Store(tmp_path).lookup(text)


# ---- digests and blobs (the /api/blobs checks) --------------------------------------------------

HEX = "a" * 64


@pytest.mark.parametrize(("digest", "ok"), [
    (f"sha256:{HEX}", True), (f"sha256-{HEX}", True), ("sha256:" + "A" * 64, True), ("sha256:" + "a" * 63, False),
    ("sha256:" + "g" * 64, False), (f"sha512:{HEX}", False), (HEX, False), ("", False),
    ("sha256:../../" + "a" * 58, False), (f"sha256:{HEX}/", False), (f"sha256:{HEX}\n", False),
])
def test_digest_format(digest: str, ok: bool) -> None:
    if ok:
        assert check_digest(digest) == "sha256:" + digest[7:].lower()
    else:
        with pytest.raises(InvalidDigest, match="invalid digest format"):
            check_digest(digest)


def test_blob_upload_created_then_existing_then_mismatch(tmp_path: Path) -> None:
    store = Store(tmp_path)
    data = b"hello blob"
    digest = "sha256:" + hashlib.sha256(data).hexdigest()
    assert not store.has_blob(digest)
    assert store.write_blob(data, digest) == (digest, True)  # POST: 201
    assert store.has_blob(digest) and store.has_blob(digest.replace(":", "-"))  # HEAD: 200
    assert (tmp_path / "blobs" / digest.replace(":", "-")).read_bytes() == data
    assert store.write_blob(b"anything", digest) == (digest, False)  # existing: 200, body not read
    other = "sha256:" + hashlib.sha256(b"other").hexdigest()
    with pytest.raises(DigestMismatch) as error:  # 400, and nothing is left behind
        store.write_blob([b"not ", b"other"], other)
    assert error.value.status == 400
    assert str(error.value) == f'digest mismatch, expected "{other}", got ' \
                               f'"sha256:{hashlib.sha256(b"not other").hexdigest()}"'
    assert sorted(p.name for p in (tmp_path / "blobs").iterdir()) == [digest.replace(":", "-")]
    with pytest.raises(InvalidDigest):
        store.has_blob("sha256:nope")


def test_blob_streams_from_a_file_and_without_a_digest(tmp_path: Path) -> None:
    source = tmp_path / "big.bin"
    source.write_bytes(os.urandom(3 << 20))
    store = Store(tmp_path / "models")
    with open(source, "rb") as f:
        digest, created = store.write_blob(f)
    assert created and digest == file_digest(source) and store.blob_path(digest).read_bytes() == source.read_bytes()
    assert oct(store.blob_path(digest).stat().st_mode & 0o777) == "0o644"


# ---- create, list, show, resolve -----------------------------------------------------------------


@pytest.fixture
def store(tmp_path: Path) -> Store:
    return Store(tmp_path / "models")


@pytest.fixture
def gguf_digest(store: Store, stories_path: Path) -> str:
    return store.add_file(stories_path)


def create(store: Store, digest: str, name: str = "stories", **kwargs: object) -> list[str]:
    statuses: list[str] = []
    store.create(name, files={"stories260K.gguf": digest}, progress=lambda p: statuses.append(p["status"]),
                 **kwargs)  # type: ignore[arg-type]
    return statuses


def test_create_writes_ollama_manifest_and_config_bytes(store: Store, gguf_digest: str) -> None:
    statuses = create(store, gguf_digest, template="{{ .Prompt }}", system="Be brief.",
                      parameters={"stop": ["<|im_end|>"], "temperature": 0.7})
    blob = store.blob_path(gguf_digest)
    path = store.root / "manifests" / "registry.ollama.ai" / "library" / "stories" / "latest"
    raw = path.read_bytes()
    doc = json.loads(raw)
    assert raw.endswith(b"}\n") and b" " not in raw.replace(str(blob).encode(), b"")  # compact, trailing newline
    assert list(doc) == ["schemaVersion", "mediaType", "config", "layers"]
    assert doc["schemaVersion"] == 2 and doc["mediaType"] == "application/vnd.docker.distribution.manifest.v2+json"
    assert doc["config"]["mediaType"] == "application/vnd.docker.container.image.v1+json"
    layers = doc["layers"]
    assert [x["mediaType"].rsplit(".", 1)[1] for x in layers] == ["model", "template", "system", "params"]
    assert layers[0] == {"mediaType": "application/vnd.ollama.image.model", "digest": gguf_digest,
                         "size": blob.stat().st_size, "from": str(blob)}
    assert list(layers[1]) == ["mediaType", "digest", "size"]
    for layer in layers + [doc["config"]]:  # every layer is a blob named by its content's sha256
        data = store.blob_path(layer["digest"]).read_bytes()
        assert layer["digest"] == "sha256:" + hashlib.sha256(data).hexdigest() and layer["size"] == len(data)
    assert store.blob_path(layers[1]["digest"]).read_bytes() == b"{{ .Prompt }}"
    assert store.blob_path(layers[3]["digest"]).read_bytes() == b'{"stop":["\\u003c|im_end|\\u003e"],' \
                                                                 b'"temperature":0.7}\n'
    config = store.blob_path(doc["config"]["digest"]).read_text()
    assert config == ('{"model_format":"gguf","model_family":"llama","model_families":["llama"],"model_type":"293K",'
                      '"file_type":"unknown","architecture":"amd64","os":"linux","rootfs":{"type":"layers",'
                      '"diff_ids":[' + ",".join(f'"{x["digest"]}"' for x in layers) + "]}}\n")
    assert statuses == ["parsing GGUF", f"using existing layer {gguf_digest}",
                        f"creating new layer {layers[1]['digest']}", f"creating new layer {layers[2]['digest']}",
                        f"creating new layer {layers[3]['digest']}", "writing manifest"]


def test_list_models(store: Store, gguf_digest: str) -> None:
    assert store.list_models() == []
    create(store, gguf_digest, "stories")
    time.sleep(0.01)
    create(store, gguf_digest, "me/other:v1", system="hi")
    models = store.list_models()
    assert [m["name"] for m in models] == ["me/other:v1", "stories:latest"]  # newest first
    entry = models[1]
    manifest = (store.root / "manifests/registry.ollama.ai/library/stories/latest").read_bytes()
    assert entry["model"] == "stories:latest" and entry["digest"] == hashlib.sha256(manifest).hexdigest()
    doc = json.loads(manifest)
    assert entry["size"] == sum(x["size"] for x in doc["layers"]) + doc["config"]["size"]
    assert entry["details"] == {"parent_model": str(store.blob_path(gguf_digest)), "format": "gguf",
                                "family": "llama", "families": ["llama"], "parameter_size": "293K",
                                "quantization_level": "unknown"}
    assert entry["modified_at"][:4].isdigit() and "T" in entry["modified_at"]


def test_show(store: Store, gguf_digest: str) -> None:
    create(store, gguf_digest, license=["MIT", "more"], messages=[{"role": "user", "content": "hi"}],
           parameters={"seed": 42, "stop": ["foo", "bar"], "top_p": 0.9})
    shown = store.show("Stories")  # lookup is case-insensitive
    assert sorted(" ".join(line.split()) for line in shown["parameters"].splitlines()) == \
        ['seed 42', 'stop "bar"', 'stop "foo"', "top_p 0.9"]
    assert shown["parameters"].splitlines()[0] == "seed" + " " * 27 + "42"
    assert shown["license"] == "MIT\nmore" and shown["messages"] == [{"role": "user", "content": "hi"}]
    assert shown["template"] == ""  # no TEMPLATE layer and no chat template in this GGUF
    assert shown["model_info"]["general.parameter_count"] == 292800
    assert "general.name" not in shown["model_info"] and shown["model_info"]["tokenizer.ggml.tokens"] == []
    assert shown["modelfile"].startswith('# Modelfile generated by "ollama show"\n# To build a new Modelfile based '
                                         "on this, replace FROM with:\n# FROM stories:latest\n\nFROM ")
    assert 'PARAMETER stop foo\nPARAMETER stop bar\nPARAMETER top_p 0.9\nLICENSE MIT\nLICENSE more\n' \
           'MESSAGE user hi\n' in shown["modelfile"]
    assert "tensors" not in shown and len(store.show("stories", verbose=True)["tensors"]) == 48
    with pytest.raises(ModelNotFound, match="model 'nope:latest' not found"):
        store.show("nope")


def test_show_template_is_the_gguf_chat_template(store: Store, smollm2_path: Path) -> None:
    digest = store.add_file(smollm2_path)
    store.create("smollm2", files={"model.gguf": digest})
    shown = store.show("smollm2")
    assert shown["template"].startswith("{% for message in messages %}")
    assert shown["details"]["quantization_level"] == "Q4_1" and shown["details"]["parameter_size"] == "134.52M"


def test_resolve(store: Store, gguf_digest: str) -> None:
    create(store, gguf_digest, template="{{ .System }}{{ .Prompt }}", system="sys", parameters={"num_ctx": 4096})
    m = store.resolve("stories:latest")
    assert m.model_path == store.blob_path(gguf_digest) and m.model_path.is_file()
    assert (m.template, m.system, m.params) == ("{{ .System }}{{ .Prompt }}", "sys", {"num_ctx": 4096})
    assert m.short_name == "stories:latest" and m.config["model_family"] == "llama"
    with pytest.raises(ModelNotFound):
        store.resolve("missing")
    with pytest.raises(InvalidName):
        store.resolve("bad/name/with/too/many")


def test_a_lookup_reads_one_manifest(store: Store, gguf_digest: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Spelled as stored, a name's lookup reads its own manifest only (every request looks its model up; a
    store of many models used to be read whole each time); spelled otherwise, the stored spelling is found."""
    for name in ("alpha", "Beta", "gamma:7b"):
        create(store, gguf_digest, name=name)
    reads: list[Path] = []
    original = Manifest.from_bytes

    def counted(data: bytes, path: Path | None = None) -> Manifest:
        reads.append(path)
        return original(data, path)

    monkeypatch.setattr(Manifest, "from_bytes", counted)
    assert str(store.lookup("Beta")[0]) == "registry.ollama.ai/library/Beta:latest"
    assert [p.parts[-2:] for p in reads] == [("Beta", "latest")]
    reads.clear()
    assert str(store.lookup("GAMMA:7B")[0]) == "registry.ollama.ai/library/gamma:7b"
    assert [p.parts[-2:] for p in reads] == [("gamma", "7b")]


@pytest.mark.parametrize(("kwargs", "error", "message"), [
    ({"model": "-bad"}, InvalidName, "invalid model name"),
    ({"files": {"/abs/model.gguf": "DIGEST"}}, BadRequest, "file path must be relative"),
    ({"files": {"../model.gguf": "DIGEST"}}, BadRequest, "file path must be relative"),
    ({"files": {"model.gguf": ""}}, InvalidDigest, "invalid digest format"),
    ({"files": {}}, BadRequest, "neither 'from' or 'files' was specified"),
    ({"files": {"model.gguf": "sha256:" + "0" * 64}}, StoreError, "no such file"),
    ({"template": "{{ .Prompt "}, BadRequest, "template error"),
    ({"from_": "nosuch"}, ModelNotFound, "not found"),
])
def test_create_errors(store: Store, gguf_digest: str, kwargs: dict, error: type, message: str) -> None:
    args = {"model": "m", "files": {"model.gguf": gguf_digest}, **kwargs}
    if "from_" in kwargs:
        del args["files"]
    args["files"] = {k: (gguf_digest if v == "DIGEST" else v) for k, v in (args.get("files") or {}).items()} \
        if "files" in args else None
    with pytest.raises(error, match=message):
        store.create(args.pop("model"), **args)
    assert not (store.root / "manifests").exists() or store.list_models() == []


def test_create_refuses_a_blob_that_is_not_gguf(store: Store) -> None:
    digest, _ = store.write_blob(b"PK\x03\x04 not a gguf")
    with pytest.raises(BadRequest, match="supplied file was not in GGUF format") as error:
        store.create("m", files={"model.gguf": digest})
    assert error.value.status == 400


def test_create_from_a_model_merges_parameters_and_shares_blobs(store: Store, gguf_digest: str) -> None:
    create(store, gguf_digest, system="base", parameters={"stop": ["a", "b"], "temperature": 0.5})
    store.create("derived", from_="stories", parameters={"stop": ["c"]}, system="derived")
    base, derived = store.resolve("stories"), store.resolve("derived")
    assert derived.model_path == base.model_path and derived.parent_model == "stories:latest"
    assert derived.params == {"stop": ["c"], "temperature": 0.5}  # a user key replaces the old value whole
    assert derived.system == "derived" and base.system == "base"
    assert store.show("derived")["details"]["families"] == ["llama"]


def test_overwriting_a_model_removes_its_blobs_that_nothing_else_uses(store: Store, gguf_digest: str) -> None:
    create(store, gguf_digest, system="first")
    first_system = store.read_manifest(parse_name("stories")).first("application/vnd.ollama.image.system")
    create(store, gguf_digest, system="second")
    assert first_system is not None and not store.blob_path(first_system.digest).exists()
    assert store.resolve("stories").system == "second" and store.blob_path(gguf_digest).exists()


# ---- copy / delete ------------------------------------------------------------------------------


def test_copy_shares_blobs_and_same_path_is_a_no_op(store: Store, gguf_digest: str) -> None:
    create(store, gguf_digest)
    store.copy("stories", "me/copy:v2")
    src = (store.root / "manifests/registry.ollama.ai/library/stories/latest").read_bytes()
    assert (store.root / "manifests/registry.ollama.ai/me/copy/v2").read_bytes() == src
    store.copy("stories", "STORIES:latest")  # the same manifest (case-insensitive): nothing happens
    assert len(store.list_models()) == 2
    with pytest.raises(ModelNotFound, match='model "nope" not found'):
        store.copy("nope", "x")
    with pytest.raises(InvalidName, match='source "-x" is invalid'):
        store.copy("-x", "y")
    with pytest.raises(InvalidName, match='destination "a/b/c/d" is invalid'):
        store.copy("stories", "a/b/c/d")


def test_delete_removes_only_blobs_no_other_manifest_uses(store: Store, gguf_digest: str) -> None:
    create(store, gguf_digest, "a", system="only a")
    create(store, gguf_digest, "ns/b:tag", system="only b")
    a, b = store.read_manifest(parse_name("a")), store.read_manifest(parse_name("ns/b:tag"))
    only_a = set(a.all_digests()) - set(b.all_digests())
    removed = store.delete("a")
    assert set(removed) == only_a and gguf_digest not in removed
    assert store.blob_path(gguf_digest).exists() and all(store.blob_path(d).exists() for d in b.all_digests())
    assert not (store.root / "manifests/registry.ollama.ai/library").exists()  # empty folders pruned
    store.delete("ns/b:tag")
    assert list((store.root / "blobs").iterdir()) == [] and list((store.root / "manifests").iterdir()) == []
    with pytest.raises(ModelNotFound, match="model 'a' not found"):
        store.delete("a")
    with pytest.raises(InvalidName, match='name "a/b/c/d" is invalid'):
        store.delete("a/b/c/d")


def test_prune_keeps_referenced_and_protected_blobs(store: Store, gguf_digest: str) -> None:
    create(store, gguf_digest)
    stray, _ = store.write_blob(b"stray")
    waiting, _ = store.write_blob(b"uploaded, waiting for create")
    assert store.prune(keep=[waiting]) == [stray]
    assert store.has_blob(waiting) and store.has_blob(gguf_digest)


# ---- a store written by Ollama ------------------------------------------------------------------


def test_reads_a_store_written_by_ollama(tmp_path: Path, stories_path: Path) -> None:
    """Go's json.Encoder bytes, an extra layer field, a legacy prompt layer: listed and resolved here."""
    root = tmp_path / "ollama"
    blobs = root / "blobs"
    blobs.mkdir(parents=True)

    def blob(data: bytes) -> tuple[str, int]:
        digest = hashlib.sha256(data).hexdigest()
        (blobs / f"sha256-{digest}").write_bytes(data)
        return f"sha256:{digest}", len(data)

    model = stories_path.read_bytes()
    md, ms = blob(model)
    pd, ps = blob(b"[INST] {{ .Prompt }} [/INST]")
    cd, cs = blob(b'{"model_format":"gguf","model_family":"llama","model_families":["llama"],"model_type":"293K",'
                  b'"file_type":"Q4_0","architecture":"amd64","os":"linux","rootfs":{"type":"layers","diff_ids":[]}}\n')
    manifest = ('{"schemaVersion":2,"mediaType":"application/vnd.docker.distribution.manifest.v2+json",'
                f'"config":{{"mediaType":"application/vnd.docker.container.image.v1+json","digest":"{cd}","size":{cs}}},'
                f'"layers":[{{"mediaType":"application/vnd.ollama.image.model","digest":"{md}","size":{ms},'
                f'"from":"/Users/x/model.gguf"}},{{"mediaType":"application/vnd.ollama.image.prompt","digest":"{pd}",'
                f'"size":{ps}}}]}}\n').encode()
    path = root / "manifests/registry.ollama.ai/Library/TinyStories/Q4_0"
    path.parent.mkdir(parents=True)
    path.write_bytes(manifest)
    (root / "manifests/registry.ollama.ai/library/junk").mkdir(parents=True)  # not a manifest: skipped

    store = Store(root)
    [entry] = store.list_models()
    assert entry["name"] == "TinyStories:Q4_0"  # "Library" is the default namespace (compared case-insensitively)
    assert entry["digest"] == hashlib.sha256(manifest).hexdigest() and entry["size"] == ms + ps + cs
    m = store.resolve("library/tinystories:q4_0")
    assert m.template == "[INST] {{ .Prompt }} [/INST]" and m.model_path == blobs / f"sha256-{md[7:]}"
    assert m.parent_model == "/Users/x/model.gguf"
    store.copy("library/tinystories:q4_0", "copy")
    assert store.blob_path(md).exists() and len(store.list_models()) == 2


def test_our_manifest_round_trips_to_the_same_bytes(store: Store, gguf_digest: str) -> None:
    create(store, gguf_digest)
    manifest = store.read_manifest(parse_name("stories"))
    assert manifest.to_bytes() == manifest.path.read_bytes()  # type: ignore[union-attr]


# ---- PARAMETER types, show's parameter lines, numbers ----------------------------------------------


@pytest.mark.parametrize(("key", "value", "expected"), [
    ("num_ctx", "4096", 4096), ("seed", "-1", -1), ("temperature", "0.7", Float32(0.7)), ("top_p", "1", Float32(1.0)),
    ("use_mmap", "true", True), ("use_mmap", "F", False), ("stop", "<|im_end|>", ["<|im_end|>"]),
])
def test_format_param(key: str, value: str, expected: object) -> None:
    typed = format_param(key, value)
    assert typed == expected and type(typed) is type(expected)


@pytest.mark.parametrize(("key", "value", "message"), [
    ("num_ctx", "4k", "invalid int value"), ("num_ctx", "1.5", "invalid int value"), ("seed", "1_000", "invalid int"),
    ("temperature", "hot", "invalid float value"), ("temperature", "inf", "invalid float value"),
    ("use_mmap", "yes", "invalid bool value"), ("nonsense", "1", "unknown parameter 'nonsense'"),
])
def test_format_param_errors(key: str, value: str, message: str) -> None:
    with pytest.raises(ParameterError, match=message):
        format_param(key, value)


def test_parameter_lines() -> None:
    assert parameter_lines({"stop": ["a", 'q"'], "num_ctx": 1000000.0, "temperature": 0.7}) == \
        "num_ctx" + " " * 24 + "1e+06\nstop" + " " * 27 + '"a"\nstop' + " " * 27 + '"q\\""\ntemperature' + \
        " " * 20 + "0.7"


@pytest.mark.parametrize(("n", "text"), [
    (54, "54"), (1000, "1K"), (292_800, "293K"), (1_000_000, "1M"), (134_515_008, "134.52M"),
    (1_000_000_000, "1B"), (1_240_000_000, "1.2B"), (25_200_000_000, "25.2B"), (33_400_000_000, "33.4B"),
])
def test_human_number(n: int, text: str) -> None:
    assert human_number(n) == text


def test_file_type_names() -> None:
    assert [file_type_name(t) for t in (None, 0, 1, 2, 3, 7, 15, 32, 99)] == \
        ["unknown", "unknown", "F16", "Q4_0", "Q4_1", "Q8_0", "Q4_K_M", "BF16", "unknown"]


# ---- Modelfiles -----------------------------------------------------------------------------------


def test_modelfile_parse() -> None:
    text = ('# a comment\nFROM ./model.gguf\nparameter temperature 0.7\nPARAMETER stop <|im_end|>\n'
            'PARAMETER stop "<|im_start|>"\nTEMPLATE """{{ if .System }}<|im_start|>system\n{{ .System }}<|im_end|>\n'
            '{{ end }}"""\nSYSTEM You are  a pirate.\nLICENSE "MIT"\nMESSAGE user Hello there\n'
            'MESSAGE assistant """Ahoy\nmatey"""\n')
    mf = parse_modelfile(text)
    assert [(c.name, c.args) for c in mf.commands] == [
        ("model", "./model.gguf"), ("temperature", "0.7"), ("stop", "<|im_end|>"), ("stop", "<|im_start|>"),
        ("template", "{{ if .System }}<|im_start|>system\n{{ .System }}<|im_end|>\n{{ end }}"),
        ("system", "You are  a pirate."), ("license", "MIT"), ("message", "user: Hello there"),
        ("message", "assistant: Ahoy\nmatey")]
    assert str(mf).splitlines()[:3] == ["FROM ./model.gguf", "PARAMETER temperature 0.7", "PARAMETER stop <|im_end|>"]
    assert 'MESSAGE assistant "Ahoy\nmatey"' in str(mf)
    assert parse_modelfile(str(mf)).commands == mf.commands  # printing round-trips


@pytest.mark.parametrize(("text", "message"), [
    ("PARAMETER temperature 1\n", "no FROM line"),
    ("FROM x\nBOGUS y\n", "command must be one of"),
    ("FROM x\nMESSAGE robot hi\n", "message role must be one of"),
    ('FROM x\nSYSTEM """never closed\n', "unexpected EOF"),
    ("FROM x\nPARAMETER temperature", "unexpected EOF"),
    ("FROM x\nPARAMETER\n", "command must be one of"),
])
def test_modelfile_errors(text: str, message: str) -> None:
    with pytest.raises(ModelfileError, match=message):
        parse_modelfile(text)


def test_modelfile_accepts_bom_and_utf16() -> None:
    assert parse_modelfile(b"\xef\xbb\xbfFROM m\n").commands[0].args == "m"
    assert parse_modelfile("FROM m\nSYSTEM héllo\n".encode("utf-16")).commands[1].args == "héllo"


def test_modelfile_create_request(tmp_path: Path, stories_path: Path) -> None:
    shutil.copy(stories_path, tmp_path / "tiny.gguf")
    mf = parse_modelfile("FROM ./tiny.gguf\nPARAMETER stop a\nPARAMETER stop b\nPARAMETER num_ctx 512\n"
                         "PARAMETER mirostat 1\nSYSTEM hi\nLICENSE one\nLICENSE two\nMESSAGE user q\n")
    request, uploads = mf.create_request(tmp_path)
    digest = file_digest(stories_path)
    assert request == {"files": {"tiny.gguf": digest}, "system": "hi", "parameters": {"stop": ["a", "b"],
                       "num_ctx": 512}, "messages": [{"role": "user", "content": "q"}], "license": ["one", "two"]}
    assert uploads == {digest: (tmp_path / "tiny.gguf").resolve()}
    request, uploads = parse_modelfile("FROM llama3.2\nPARAMETER temperature 0.1\n").create_request(tmp_path)
    assert request == {"from": "llama3.2", "parameters": {"temperature": Float32(0.1)}} and uploads == {}
    with pytest.raises(ParameterError, match="unknown parameter 'bogus'"):
        parse_modelfile("FROM x\nPARAMETER bogus 1\n").create_request(tmp_path)


def test_create_from_modelfile_end_to_end(tmp_path: Path, stories_path: Path) -> None:
    shutil.copy(stories_path, tmp_path / "tiny.gguf")
    (tmp_path / "Modelfile").write_text("FROM ./tiny.gguf\nTEMPLATE {{ .Prompt }}\nPARAMETER temperature 0.7\n"
                                        "PARAMETER stop <|im_end|>\n")
    store = Store(tmp_path / "models")
    mf = parse_modelfile((tmp_path / "Modelfile").read_text())
    statuses: list[str] = []
    name = store.create_from_modelfile("tiny", mf, tmp_path, progress=lambda p: statuses.append(p["status"]))
    assert name.display_shortest() == "tiny:latest" and statuses[-1] == "writing manifest"
    resolved = store.resolve("tiny")
    assert resolved.params == {"stop": ["<|im_end|>"], "temperature": 0.7} and resolved.template == "{{ .Prompt }}"
    params_layer = store.read_manifest(name).first("application/vnd.ollama.image.params")
    assert params_layer is not None
    assert store.blob_path(params_layer.digest).read_bytes() == \
        b'{"stop":["\\u003c|im_end|\\u003e"],"temperature":0.7}\n'

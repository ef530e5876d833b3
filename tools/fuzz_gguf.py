"""Fuzz the GGUF reader and model loading with damaged files: every case must end in a clear error or a valid load.

Each case is a seed model (every tiny synthetic preset of tests/synthetic/models.py, the real TinyStories llama) with
1 to 3 mutations, drawn from a seeded random generator so that a case number always gives the same file:

- bytes: truncation, flipped bytes, inserted or deleted bytes (mostly in the header, metadata and tensor infos);
- fields: a count, string length, value type, tensor dimension, type or data offset of the file set to an absurd
  value (0, 2^32-1, 2^63, 2^64-1, the file size, its neighbour ±1);
- semantic: the file rewritten whole with a hyper-parameter of the wrong type or an absurd value, a key or tensor
  removed, a tensor's shape changed (so it no longer matches the architecture), two tensors' data overlapping,
  token ids out of the vocabulary, a vocabulary shorter or longer than the embedding matrix.

A worker subprocess parses each case (GGUFFile.open) and, when that succeeds, loads it the way the runner does
(open_model: weights, KV cache, worst-case graphs), reads the weights, and computes one token (or one embedding).
Allowed outcomes: success, or one of the engine's error types with a message. A failure is any other exception
(IndexError, ZeroDivisionError, ...), the worker dying (ggml abort, segfault), a case running past the time limit,
or the worker's memory passing its limit (RLIMIT_AS). A dead worker is replaced and the run goes on.

    .venv/bin/python tools/fuzz_gguf.py --cases 10000            # the full run (RELIABILITY.md)
    .venv/bin/python tools/fuzz_gguf.py --cases 200 --seed 7     # any other slice
    .venv/bin/python tools/fuzz_gguf.py --replay 1234 --out case.gguf   # write one case's file

tests/test_fuzz_gguf.py runs a bounded slice in CI.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import random
import select
import struct
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))  # the synthetic models

ROOT = Path(__file__).resolve().parent.parent
F16_SEEDS = ("tiny-llama", "tiny-bert")  # the other presets are written with Q4_0 weights
CASE_TIMEOUT = 60.0  # seconds for one case (a tiny model loads in well under a second)
MEMORY_LIMIT = 4 << 30  # the worker's address space (RLIMIT_AS): a file must not make it allocate more
INTERESTING_U64 = (0, 1, 2, 3, 7, 64, 255, 4096, 65535, 2**31 - 1, 2**31, 2**32 - 1, 2**32, 2**62,
                   2**63 - 1, 2**63, 2**64 - 2, 2**64 - 1)
FLOATS = (0.0, -0.0, -1.0, 1e-45, 1e38, 3.4e38, math.inf, -math.inf, math.nan)


# ------------------------------------------------------------------------------------------ seeds


def write_seeds(directory: Path) -> list[Path]:
    """The seed corpus: one tiny synthetic model per architecture, and the real TinyStories llama."""
    from synthetic.models import PRESETS, write_synthetic

    from ollama_engine.fs import GGUFError, GGUFFile

    directory.mkdir(parents=True, exist_ok=True)
    seeds = []
    for preset in sorted(p for p in PRESETS if p.startswith("tiny-")):
        path = directory / f"{preset}.gguf"
        try:
            if not path.exists():  # quantized, so that the files (and each case) stay small
                write_synthetic(path, preset, seed=1, weight_type="F16" if preset in F16_SEEDS else "Q4_0")
            GGUFFile.open(path)
        except (GGUFError, ValueError) as err:  # a preset this engine cannot read yet is no seed
            print(f"skipping seed {preset}: {err}", file=sys.stderr)
            continue
        seeds.append(path)
    stories = ROOT / "tests" / "data" / "stories260K.gguf"
    if stories.exists():
        seeds.append(stories)
    return seeds


# ------------------------------------------------------------------------------------------ structure


@dataclass(frozen=True)
class Field:
    """One integer field of a GGUF file: where it is, how wide, and what it means."""

    offset: int
    width: int  # bytes: 4 or 8 (or the scalar's width for a metadata value)
    kind: str  # count, strlen, vtype, etype, value, ndims, dim, ttype, toffset, version
    fmt: str  # struct format of the field


def fields(data: bytes) -> tuple[list[Field], int]:
    """Every integer field of a valid GGUF file, and where its tensor infos end."""
    out: list[Field] = []
    pos = 8  # magic, version
    out.append(Field(4, 4, "version", "<I"))

    def u(fmt: str, kind: str) -> int:
        nonlocal pos
        size = struct.calcsize(fmt)
        out.append(Field(pos, size, kind, fmt))
        value = struct.unpack_from(fmt, data, pos)[0]
        pos += size
        return value

    def string() -> None:
        nonlocal pos
        n = u("<Q", "strlen")
        pos += n

    scalar = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<B", 10: "<Q", 11: "<q", 12: "<d"}
    n_tensors = u("<Q", "count")
    n_kv = u("<Q", "count")
    for _ in range(n_kv):
        string()
        vtype = u("<I", "vtype")
        if vtype == 9:
            etype = u("<I", "etype")
            count = u("<Q", "count")
            if etype == 8:
                for _ in range(count):
                    if len(out) < 4000:
                        string()
                    else:  # a vocabulary: keep the first strings' fields only
                        pos += 8 + struct.unpack_from("<Q", data, pos)[0]
            else:
                pos += count * struct.calcsize(scalar[etype])
        elif vtype == 8:
            string()
        else:
            u(scalar[vtype], "value")
    for _ in range(n_tensors):
        string()
        n_dims = u("<I", "ndims")
        for _ in range(n_dims):
            u("<Q", "dim")
        u("<I", "ttype")
        u("<Q", "toffset")
    return out, pos


# ------------------------------------------------------------------------------------------ rewriting


@dataclass
class Tensor:
    name: str
    ggml_type: int
    shape: list[int]
    data: bytes
    offset: int | None = None  # relative data offset; None: laid out after the previous tensor


@dataclass
class Model:
    """A GGUF file as values, to be damaged semantically and written back."""

    metadata: dict[str, tuple[int, int | None, Any]]  # key -> (value type, element type, value)
    tensors: list[Tensor]
    alignment: int = 32
    encoded: dict[str, tuple[Any, bytes]] = dataclasses.field(default_factory=dict)  # key -> (entry read, bytes)

    @classmethod
    def read(cls, path: Path) -> Model:
        from ollama_engine.fs import GGUFFile

        f = GGUFFile.open(path)
        metadata = {k: (int(vt), None if et is None else int(et), f.metadata[k])
                    for k, (vt, et) in f.value_types.items()}
        raw = path.read_bytes()
        tensors = [Tensor(t.name, int(t.ggml_type) if t.conversion is None else t.conversion.file_type_id,
                          list(t.shape), raw[t.offset:t.offset + t.n_bytes]) for t in f.tensors.values()]
        model = cls(metadata, tensors, f.alignment)
        model.encoded = {key: (entry, _kv_bytes(key, entry)) for key, entry in metadata.items()}
        return model

    def to_bytes(self) -> bytes:
        out = bytearray(b"GGUF" + struct.pack("<IQQ", 3, len(self.tensors), len(self.metadata)))
        for key, entry in self.metadata.items():
            cached = self.encoded.get(key)
            if cached is not None and cached[0] is entry:  # unchanged since read: its bytes are known
                out += cached[1]
                continue
            out += _kv_bytes(key, entry)
        cursor = 0
        offsets = []
        for t in self.tensors:
            offset = cursor if t.offset is None else t.offset
            offsets.append(offset)
            out += _string(t.name) + struct.pack("<I", len(t.shape))
            out += b"".join(struct.pack("<Q", d & (2**64 - 1)) for d in t.shape)
            out += struct.pack("<IQ", t.ggml_type, offset)
            cursor = max(cursor, offset + _pad(len(t.data), self.alignment))
        out += bytes(_pad(len(out), self.alignment) - len(out))
        data = bytearray(cursor)
        for t, offset in zip(self.tensors, offsets, strict=True):
            data[offset:offset + len(t.data)] = t.data
        return bytes(out + data)


def _kv_bytes(key: str, entry: tuple[int, int | None, Any]) -> bytes:
    vtype, etype, value = entry
    out = bytearray(_string(key) + struct.pack("<I", vtype))
    if vtype == 9:
        out += struct.pack("<IQ", etype, len(value))
        for item in value:
            out += _value(etype, item)
    else:
        out += _value(vtype, value)
    return bytes(out)


def _pad(n: int, alignment: int) -> int:
    return -(-n // alignment) * alignment


def _string(s: str) -> bytes:
    raw = s.encode("utf-8", "surrogatepass")
    return struct.pack("<Q", len(raw)) + raw


def _value(vtype: int, value: Any) -> bytes:
    fmt = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<B", 10: "<Q", 11: "<q", 12: "<d"}
    if vtype == 8:
        return _string(str(value))
    code = fmt[vtype]
    if code in "<f<d":
        return struct.pack(code, float(value))
    bits = struct.calcsize(code) * 8
    value = int(value)
    if code[1].islower():  # signed: wrap into range
        value = (value + 2 ** (bits - 1)) % 2**bits - 2 ** (bits - 1)
    else:
        value %= 2**bits
    return struct.pack(code, value)


def _tensor_bytes(ggml_type: int, shape: list[int]) -> int | None:
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    try:
        block, size = GGML_QUANT_SIZES[GGMLQuantizationType(ggml_type)]
    except (ValueError, KeyError):
        return None
    n = math.prod(shape)
    if n < 0 or shape[0] % block or n // block * size > 64 << 20:
        return None
    return n // block * size


# ------------------------------------------------------------------------------------------ mutations


def _interesting(rng: random.Random, original: int, width: int) -> int:
    limit = 2 ** (width * 8) - 1
    choices = [v for v in INTERESTING_U64 if v <= limit]
    choices += [max(original - 1, 0), min(original + 1, limit), min(original * 2, limit), original // 2,
                rng.randrange(limit + 1)]
    return rng.choice(choices)


def mutate_bytes(data: bytes, rng: random.Random) -> bytes:
    """Raw damage, mostly in the first 64 KiB (header, metadata, tensor infos)."""
    buf = bytearray(data)
    hot = min(len(buf), 1 << 16)

    def spot() -> int:
        return rng.randrange(hot if rng.random() < 0.8 else len(buf))

    kind = rng.choice(["truncate", "flip", "flip", "insert", "delete", "zero"])
    if kind == "truncate":
        return bytes(buf[:spot()])
    if kind == "flip":
        for _ in range(rng.randint(1, 16)):
            buf[spot()] ^= 1 << rng.randrange(8)
    elif kind == "insert":
        at = spot()
        buf[at:at] = rng.randbytes(rng.randint(1, 16))
    elif kind == "delete":
        at = spot()
        del buf[at:at + rng.randint(1, 64)]
    else:
        at = spot()
        n = rng.randint(1, 256)
        buf[at:at + n] = bytes(len(buf[at:at + n]))
    return bytes(buf)


def mutate_field(data: bytes, rng: random.Random) -> bytes:
    """One integer field of the file's structure set to an absurd or neighbouring value."""
    try:
        structure, _ = fields(data)
    except (struct.error, KeyError, IndexError, OverflowError, ValueError):  # already damaged earlier
        return mutate_bytes(data, rng)
    weights = {"count": 4, "strlen": 2, "vtype": 2, "etype": 2, "value": 3, "ndims": 2, "dim": 4, "ttype": 3,
               "toffset": 4, "version": 1}
    field = rng.choices(structure, [weights[f.kind] for f in structure])[0]
    buf = bytearray(data)
    if field.fmt in ("<f", "<d"):
        struct.pack_into(field.fmt, buf, field.offset, rng.choice(FLOATS))
        return bytes(buf)
    original = int.from_bytes(buf[field.offset:field.offset + field.width], "little")
    if field.kind in ("vtype", "etype") and rng.random() < 0.7:
        value = rng.randrange(14)
    elif field.kind == "ttype" and rng.random() < 0.7:
        value = rng.randrange(42)
    elif field.kind == "toffset" and rng.random() < 0.5:
        others = [int.from_bytes(buf[f.offset:f.offset + 8], "little") for f in structure if f.kind == "toffset"]
        value = rng.choice(others) + rng.choice([0, 0, 32, len(data)])
    else:
        value = _interesting(rng, original, field.width)
    buf[field.offset:field.offset + field.width] = (value % 2 ** (field.width * 8)).to_bytes(field.width, "little")
    return bytes(buf)


_HPARAMS = ("block_count", "embedding_length", "feed_forward_length", "attention.head_count",
            "attention.head_count_kv", "attention.key_length", "attention.value_length", "context_length",
            "rope.dimension_count", "rope.freq_base", "attention.layer_norm_rms_epsilon",
            "attention.layer_norm_epsilon", "attention.sliding_window", "pooling_type", "vocab_size",
            "rope.scaling.factor", "attn_logit_softcapping", "final_logit_softcapping")
_TOKEN_KEYS = ("tokenizer.ggml.bos_token_id", "tokenizer.ggml.eos_token_id", "tokenizer.ggml.unknown_token_id",
               "tokenizer.ggml.padding_token_id", "tokenizer.ggml.seperator_token_id")


def mutate_model(model: Model, rng: random.Random) -> None:
    """Damage that keeps the file well-formed: what only the model loader can catch."""
    arch = model.metadata.get("general.architecture", (8, None, ""))[2]
    kind = rng.choice(["hparam", "hparam", "hparam_type", "drop_key", "token_id", "vocab", "vocab_array",
                       "shape", "shape", "drop_tensor", "tensor_type", "overlap", "architecture", "rename"])
    keys = [k for k in (f"{arch}.{h}" for h in _HPARAMS) if k in model.metadata] or list(model.metadata)
    if kind == "hparam":
        key = rng.choice(keys)
        vtype, _, value = model.metadata[key]
        if vtype in (8, 9):  # a string or an array: set a number in its place
            vtype, value = 4, 1
        if vtype in (6, 12):
            new: Any = rng.choice(FLOATS)
        else:
            new = rng.choice([0, 1, 2, 3, int(value) + 1, max(int(value) - 1, 0), int(value) * 2, 2**31 - 1,
                              2**32 - 1, 10**6, 1 << 40])
            vtype = 10 if new >= 2**32 else vtype
        model.metadata[key] = (vtype, None, new)
    elif kind == "hparam_type":
        key = rng.choice(keys)
        _, _, value = model.metadata[key]
        value = value if isinstance(value, (int, float)) else 1
        model.metadata[key] = rng.choice([(8, None, str(value)), (6, None, float(value)), (7, None, True),
                                          (5, None, -abs(int(value)) - 1), (9, 4, [int(value)] * 3), (9, 8, [])])
    elif kind == "drop_key":
        del model.metadata[rng.choice(keys + [k for k in model.metadata if k.startswith("tokenizer.")])]
    elif kind == "token_id":
        key = rng.choice(_TOKEN_KEYS)
        model.metadata[key] = (rng.choice([4, 5]), None, rng.choice([-1, 2**31 - 1, 10**6, 2**32 - 1]))
    elif kind == "vocab":
        tokens = model.metadata.get("tokenizer.ggml.tokens")
        if tokens:
            n = len(tokens[2])
            keep = rng.choice([0, 1, 2, n // 2, n - 1, n + 1, n * 2])
            for key in ("tokenizer.ggml.tokens", "tokenizer.ggml.scores", "tokenizer.ggml.token_type"):
                if key in model.metadata and rng.random() < 0.7:
                    vt, et, values = model.metadata[key]
                    values = list(values)[:keep] + list(values)[: max(keep - len(values), 0)]
                    model.metadata[key] = (vt, et, values)
    elif kind == "vocab_array":
        key = rng.choice([k for k in model.metadata if k.startswith("tokenizer.ggml.")] or list(model.metadata))
        vt, et, values = model.metadata[key]
        model.metadata[key] = rng.choice([(9, 4, [2**32 - 1] * 4), (9, 8, ["", "\x00", "a" * 1000]), (9, 6, [math.nan]),
                                          (8, None, "not an array"), (9, 7, [True, False])])
    elif kind in ("shape", "tensor_type"):
        t = rng.choice(model.tensors)
        if kind == "shape":
            dims = list(t.shape)
            choice = rng.randrange(5)
            if choice == 0 and len(dims) > 1:
                dims[0], dims[1] = dims[1], dims[0]
            elif choice == 1:
                i = rng.randrange(len(dims))
                dims[i] = rng.choice([1, 2, dims[i] // 2 or 1, dims[i] * 2, dims[i] + 32])
            elif choice == 2:
                dims = dims[:-1] or [1]
            elif choice == 3:
                dims = dims + [rng.choice([1, 2])]
            else:
                dims = [math.prod(dims)]
        else:
            dims = list(t.shape)
            t.ggml_type = rng.choice([0, 1, 8, 30, 2, 12, 14])
        n = _tensor_bytes(t.ggml_type, dims)
        if n is None:
            t.shape = dims
        else:
            t.shape = dims
            t.data = (t.data * (n // max(len(t.data), 1) + 1))[:n] if t.data else bytes(n)
    elif kind == "drop_tensor":
        model.tensors.remove(rng.choice(model.tensors))
    elif kind == "overlap":
        if len(model.tensors) > 1:
            a, b = rng.sample(range(len(model.tensors)), 2)
            cursor = 0
            for t in model.tensors:
                t.offset = cursor
                cursor += _pad(len(t.data), model.alignment)
            model.tensors[b].offset = model.tensors[a].offset
    elif kind == "architecture":
        model.metadata["general.architecture"] = (8, None, rng.choice(["llama", "qwen2", "qwen3", "bert", "gemma2",
                                                                       "", "unknown", "llama\x00"]))
    else:  # rename: a tensor under another layer's or architecture's name
        t = rng.choice(model.tensors)
        t.name = rng.choice(["blk.99.attn_q.weight", "output.weight", "token_embd.weight", "blk.0.attn_q.weight",
                             "blk.1.ffn_up.weight", t.name + ".x"])
        names = [x.name for x in model.tensors]
        if names.count(t.name) > 1:
            model.tensors = [x for x in model.tensors if x is t or x.name != t.name]


_SEEDS: dict[Path, Model] = {}


def _read_seed(path: Path) -> Model:
    """A fresh copy of the seed's values (its encoded metadata shared): mutations replace entries, never edit."""
    if path not in _SEEDS:
        _SEEDS[path] = Model.read(path)
    seed = _SEEDS[path]
    tensors = [dataclasses.replace(t, shape=list(t.shape)) for t in seed.tensors]
    return Model(dict(seed.metadata), tensors, seed.alignment, seed.encoded)


def make_case(seeds: list[Path], index: int, seed: int = 0) -> tuple[bytes, str]:
    """Case `index` of run `seed`: the damaged file's bytes, and a description of what was done."""
    rng = random.Random(f"{seed}:{index}")
    source = rng.choice(seeds)
    steps: list[str] = []
    data = source.read_bytes()
    family = rng.choices(["bytes", "field", "semantic"], [3, 4, 5])[0]
    if family == "semantic":
        model = _read_seed(source)
        for _ in range(rng.randint(1, 3)):
            mutate_model(model, rng)
        data = model.to_bytes()
        steps.append("semantic")
        if rng.random() < 0.2:
            data = mutate_field(data, rng)
            steps.append("field")
    else:
        for _ in range(rng.randint(1, 3)):
            data = mutate_bytes(data, rng) if family == "bytes" else mutate_field(data, rng)
            steps.append(family)
    return data, f"{source.name}: {'+'.join(steps)}"


# ------------------------------------------------------------------------------------------ the worker


def allowed_errors() -> tuple[type[BaseException], ...]:
    """The engine's own error types: a case that ends in one of these was refused clearly."""
    from ollama_engine.fs import GGUFError
    from ollama_engine.ml import NoMemory
    from ollama_engine.ml.tensor import ShapeError
    from ollama_engine.models import ModelError
    from ollama_engine.runner.sequence import InputTooLongError

    return GGUFError, ModelError, ShapeError, NoMemory, InputTooLongError


def deliberate(err: BaseException) -> bool:
    """A ValueError that the engine's own code raised (in a file of this repository), as opposed to one that
    escaped from numpy or the standard library with a message about their internals."""
    import traceback

    if not isinstance(err, ValueError) or err.__traceback__ is None:
        return False
    frame = traceback.extract_tb(err.__traceback__)[-1]
    return Path(frame.filename).resolve().is_relative_to(ROOT) and ".venv" not in Path(frame.filename).parts


def check_file(path: str) -> dict[str, Any]:
    """Parse, then load as the runner does and compute one token: the outcome as a JSON-able dict."""
    import numpy as np

    from ollama_engine.fs import GGUFFile
    from ollama_engine.generate import prefill
    from ollama_engine.runner.allocate import LoadParams, open_model
    from ollama_engine.runner.embed import embed, supports_embeddings
    from ollama_engine.sample import Sampler

    allowed = allowed_errors()
    stage = "parse"
    try:
        GGUFFile.open(path)
        stage = "load"
        loaded = open_model(path, LoadParams(parallel=1, batch_size=32, kv_size=256, num_threads=1), allocate=True)
        try:
            model = loaded.model
            model.backend.load()
            stage = "compute"
            if supports_embeddings(model):
                embed(model, "Once upon a time", loaded.input_cache.num_ctx)
            else:
                assert model.tokenizer is not None
                tokens = model.tokenizer.encode("Once upon a time")[:16] or [0]
                logits = prefill(model, tokens, 0, 32)
                token = Sampler(temperature=0).sample(np.asarray(logits))
                model.tokenizer.vocab.piece(token, special=False)
        finally:
            loaded.close()
    except Exception as err:  # noqa: BLE001 - anything but a deliberate refusal is what the fuzzer looks for
        if isinstance(err, allowed) or deliberate(err):
            return {"outcome": "refused", "stage": stage, "error": type(err).__name__, "message": str(err)[:300]}
        import traceback

        return {"outcome": "failure", "stage": stage, "error": type(err).__name__, "message": str(err)[:300],
                "traceback": traceback.format_exc()[-2000:]}
    return {"outcome": "loaded", "stage": stage}


def worker() -> None:
    """Read case paths from stdin, write one JSON outcome per line to stdout."""
    import logging
    import resource

    logging.disable(logging.CRITICAL)
    resource.setrlimit(resource.RLIMIT_AS, (MEMORY_LIMIT, MEMORY_LIMIT))
    out = os.fdopen(os.dup(1), "w")
    os.dup2(os.open(os.devnull, os.O_WRONLY), 1)  # ggml's prints must not mix into the protocol
    for line in sys.stdin:
        result = check_file(line.strip())
        result["max_rss_kib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        out.write(json.dumps(result) + "\n")
        out.flush()


class Worker:
    """The worker subprocess, restarted after it dies."""

    def __init__(self) -> None:
        self.process: subprocess.Popen[str] | None = None
        self.max_rss_kib = 0

    def start(self) -> subprocess.Popen[str]:
        if self.process is None or self.process.poll() is not None:
            env = {**os.environ, "PYTHONPATH": str(ROOT)}
            self.process = subprocess.Popen(
                [sys.executable, __file__, "--worker"], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                stderr=subprocess.PIPE, text=True, env=env, cwd=ROOT)
        return self.process

    def check(self, path: Path, timeout: float = CASE_TIMEOUT) -> dict[str, Any]:
        process = self.start()
        assert process.stdin is not None and process.stdout is not None
        process.stdin.write(f"{path}\n")
        process.stdin.flush()
        ready, _, _ = select.select([process.stdout], [], [], timeout)
        line = process.stdout.readline() if ready else ""
        if line:
            result = json.loads(line)
            self.max_rss_kib = max(self.max_rss_kib, result.get("max_rss_kib", 0))
            return result
        if not ready:
            process.kill()
            process.wait()
            return {"outcome": "failure", "error": "timeout", "message": f"no answer in {timeout:.0f} s"}
        code = process.wait()
        stderr = process.stderr.read() if process.stderr else ""
        return {"outcome": "failure", "error": "worker died", "message": f"exit code {code}: {stderr[-1500:]}"}

    def close(self) -> None:
        if self.process is not None and self.process.poll() is None:
            assert self.process.stdin is not None
            self.process.stdin.close()
            try:
                self.process.wait(30)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()


@dataclass
class Report:
    cases: int = 0
    outcomes: Counter = dataclasses.field(default_factory=Counter)  # loaded / refused / failure
    stages: Counter = dataclasses.field(default_factory=Counter)  # where refusals happened
    failures: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    max_rss_mib: float = 0.0
    seconds: float = 0.0

    def summary(self) -> str:
        refused = ", ".join(f"{stage} {n}" for stage, n in sorted(self.stages.items()))
        return (f"{self.cases} cases in {self.seconds:.0f} s: {self.outcomes['loaded']} loaded and computed, "
                f"{self.outcomes['refused']} refused with a clear error ({refused}), "
                f"{self.outcomes['failure']} failures; worker peak RSS {self.max_rss_mib:.0f} MiB")


def run(cases: int, seed: int = 0, start: int = 0, seeds_dir: Path | None = None,
        progress: Callable[[int, Report], None] | None = None) -> Report:
    """Run cases start..start+cases-1 of `seed`; failures are listed in the report with their case number."""
    report = Report()
    began = time.monotonic()
    from ollama_engine.fs import GGUFError, GGUFFile

    memory = "/dev/shm" if os.path.isdir("/dev/shm") else None  # cases are written and read once
    with tempfile.TemporaryDirectory(prefix="fuzz-gguf-", dir=memory) as tmp:
        seeds = write_seeds(seeds_dir or Path(tmp) / "seeds")
        worker_ = Worker()
        case_path = Path(tmp) / "case.gguf"
        try:
            for index in range(start, start + cases):
                data, description = make_case(seeds, index, seed)
                case_path.write_bytes(data)
                try:  # parsing is pure Python and bounded by the file: a refusal here needs no worker
                    GGUFFile.open(case_path)
                    result = worker_.check(case_path)
                except GGUFError as err:
                    result = {"outcome": "refused", "stage": "parse", "error": "GGUFError", "message": str(err)}
                except Exception as err:  # noqa: BLE001 - the parser let another error escape
                    result = {"outcome": "failure", "stage": "parse", "error": type(err).__name__,
                              "message": str(err)[:300]}
                report.cases += 1
                report.seconds = time.monotonic() - began
                report.max_rss_mib = worker_.max_rss_kib / 1024
                report.outcomes[result["outcome"]] += 1
                if result["outcome"] == "refused":
                    report.stages[result["stage"]] += 1
                elif result["outcome"] == "failure":
                    report.failures.append({"case": index, "seed": seed, "what": description, **result})
                if progress is not None:
                    progress(index, report)
        finally:
            worker_.close()
        report.max_rss_mib = worker_.max_rss_kib / 1024
    report.seconds = time.monotonic() - began
    return report


def cases_of(report: Report) -> Iterator[str]:
    for failure in report.failures:
        yield (f"case {failure['case']} (seed {failure['seed']}, {failure['what']}): {failure['error']}: "
               f"{failure['message']}\n{failure.get('traceback', '')}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--cases", type=int, default=1000)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--start", type=int, default=0, help="first case number")
    parser.add_argument("--replay", type=int, help="write case N's file to --out and check it in this process")
    parser.add_argument("--out", type=Path, default=Path("case.gguf"))
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker()
        return 0
    if args.replay is not None:
        with tempfile.TemporaryDirectory() as tmp:
            data, description = make_case(write_seeds(Path(tmp)), args.replay, args.seed)
        args.out.write_bytes(data)
        print(f"case {args.replay}: {description} -> {args.out}")
        print(json.dumps(check_file(str(args.out)), indent=1))
        return 0

    shown = 0

    def progress(index: int, report: Report) -> None:
        nonlocal shown
        for text in list(cases_of(report))[shown:]:  # each failure as soon as it happens
            print(text, flush=True)
        shown = len(report.failures)
        if report.cases % 500 == 0:
            print(f"  {report.summary()}", file=sys.stderr, flush=True)

    report = run(args.cases, args.seed, args.start, progress=progress)
    print(report.summary())
    return 1 if report.failures else 0


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    sys.exit(main())

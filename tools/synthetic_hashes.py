"""The sha256 of every synthetic model the tests write, to show that a change of the writer changed no file.

Run it before and after a refactor of tests/synthetic/ (same seed, same machine: quantized types go through
ggml's quantizers, whose rounding is the machine's) and compare:

    .venv/bin/python tools/synthetic_hashes.py --out before.json
    ... change the writer ...
    .venv/bin/python tools/synthetic_hashes.py --out after.json --compare before.json

Every tiny preset in F32, Q8_0 and Q4_0, and the variants the tests write (other weight types, embedding and
expert types, every Ollama layout, deepseek2's older conversions, laguna's gate per element, gemma4's experts,
the reranker); the two large presets by their tensor lists and specs alone (writing them takes minutes).
About a minute on two cores.

--tensors hashes each tensor instead: name -> sha256 of its (type, shape, data), and the file's hash without
its tensor infos and data. A change that only reorders a file's tensors (which changes no behaviour) then
shows as "order" in the comparison, not as a difference.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import sys
import tempfile
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))  # the synthetic models

from synthetic import models  # noqa: E402
from synthetic.models import PRESETS, LagunaSpec, MLASpec, write_synthetic  # noqa: E402

from ollama_engine.fs import GGUFFile  # noqa: E402

LARGE = ("smollm2-135m", "llama-3.2-1b")


def variants() -> list[tuple[str, str, dict[str, Any]]]:
    """(preset, weight type, overrides) of every file written."""
    found = [(name, wt, {}) for name in PRESETS if name not in LARGE for wt in ("F32", "Q8_0", "Q4_0")]
    found += [("tiny-llama", "F16", {}), ("tiny-qwen2", "BF16", {}),
              ("tiny-llama", "Q4_K", {"n_embd": 256, "n_ff": 256}),
              ("tiny-llama", "Q8_0", {"embedding_type": "F16", "tied_embeddings": True}),
              ("tiny-gpt-oss", "Q8_0", {"expert_type": "Q8_0"})]
    found += [("tiny-gpt-oss", "Q8_0", {"layout": layout})
              for layout in ("ollama", "ollama-qkv", "ollama-2025-09", "ollama-2025-08")]
    found += [(name, "F16", {"layout": "ollama"}) for name in ("tiny-olmo3", "tiny-glm4moelite", "tiny-laguna")]
    found += [("tiny-deepseek2", "F16", {"mla": MLASpec()}),
              ("tiny-deepseek2", "F16", {"mla": MLASpec(q_lora_rank=32, kv_b=True), "n_head_kv": 4}),
              ("tiny-laguna", "F16", {"laguna": LagunaSpec(n_head_swa=6, rope_dims_swa=24, n_ff_shexp=64,
                                                           gate_per_element=True)})]
    experts = {"n_expert": 4, "n_expert_used": 2, "n_ff_exp": 32}
    fused = dataclasses.replace(PRESETS["tiny-gemma4"].gemma4, fused_gate_up=True)
    found += [("tiny-gemma4", "F16", experts), ("tiny-gemma4", "F16", {**experts, "gemma4": fused}),
              ("tiny-bert", "F16", {"pooling_type": 4}), ("tiny-nomic-bert-moe", "F16", {"qkv_bias": False})]
    return found


def per_tensor(path: Path) -> dict[str, Any]:
    """The file's tensors by name (sha256 of the type the file stores, the shape and the bytes), their order,
    and the hash of its metadata."""
    model, raw = GGUFFile.open(path), path.read_bytes()
    tensors = {name: hashlib.sha256(repr((str(t.file_type), t.shape)).encode()
                                    + raw[t.offset:t.offset + t.n_bytes]).hexdigest()
               for name, t in model.tensors.items()}
    keys = repr([(key, model.value_types[key], value) for key, value in model.metadata.items()])
    return {"tensors": tensors, "order": list(model.tensors), "keys": hashlib.sha256(keys.encode()).hexdigest()}


def hashes(tensors: bool = False) -> dict[str, Any]:
    out: dict[str, Any] = {}
    with tempfile.TemporaryDirectory() as folder:
        for i, (name, weight_type, overrides) in enumerate(variants()):
            key = f"{name}|{weight_type}|{sorted((k, repr(v)) for k, v in overrides.items())}"
            path = write_synthetic(Path(folder) / f"{i}.gguf", name, weight_type=weight_type, **overrides)
            out[key] = per_tensor(path) if tensors else hashlib.sha256(path.read_bytes()).hexdigest()
            path.unlink()
    for name in LARGE:  # their tensors as the writer plans them, and the spec
        spec = models.resolve_spec(name)
        plan = models._tensor_plan(spec, 49152, models.WEIGHT_TYPES["Q4_0"][0])
        listed = repr([(t.name, t.shape, t.kind, t.qtype) for t in plan])
        out[f"{name}|plan"] = hashlib.sha256(listed.encode()).hexdigest()
        out[f"{name}|spec"] = repr(spec)
    return out


def compare(now: dict[str, Any], before: dict[str, Any]) -> tuple[list[str], list[str]]:
    """The keys whose files (or tensors, keys, plans) differ, and those whose tensors only come in another order."""
    differ, reordered = [], []
    for key in sorted(now.keys() | before.keys()):
        a, b = now.get(key), before.get(key)
        if isinstance(a, dict) and isinstance(b, dict) and a["tensors"] == b["tensors"] and a["keys"] == b["keys"]:
            if a["order"] != b["order"]:
                reordered.append(key)
        elif a != b:
            differ.append(key)
    return differ, reordered


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True, help="where to write the hashes (JSON)")
    parser.add_argument("--compare", type=Path, help="hashes written before: list every file that differs")
    parser.add_argument("--tensors", action="store_true", help="hash each tensor (name -> type, shape, data)")
    args = parser.parse_args()
    now = hashes(args.tensors)
    args.out.write_text(json.dumps(now, indent=1))
    if args.compare is None:
        print(f"{len(now)} files hashed")
        return 0
    differ, reordered = compare(now, json.loads(args.compare.read_text()))
    for key in reordered:
        print(f"same tensors, other order: {key}")
    for key in differ:
        print(f"differs: {key}")
    print(f"{len(now)} files, {len(differ)} differ, {len(reordered)} only in their tensors' order")
    return 1 if differ else 0


if __name__ == "__main__":
    sys.exit(main())

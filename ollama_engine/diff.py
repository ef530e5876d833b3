"""`ollama-engine diff`: the first layer and tensor where our graph of a model departs from llama.cpp's.

Both engines run the same token ids (our tokenizer's; llama.cpp's own tokens are compared too) through
the same GGUF, every row's logits wanted, and copy out the intermediate tensors they name alike with a
ggml eval callback (`ml.TensorCapture`; our names follow llama.cpp's, see models/base.py): `attn_norm-3`,
`Qcur-3`, ..., `l_out-3`, `result_norm`, `result_output`. Then each side continues greedily for a few
tokens, so that a difference too small to see in one tensor still shows if it changes the text.

Memory stays bounded: the engines run one after the other, and no tensor is kept in memory. Ours runs
first; each named tensor of the layers asked for (`--layers`) is written to a temporary folder as it is
produced. Then llama.cpp runs, and each of its tensors of a name we produced is compared as it is
computed with ours read back from disk, then dropped. Memory holds one model and the largest compared
tensor twice; the folder holds our compared tensors as float32 (delete-on-exit, under $TMPDIR).
llama.cpp names several nodes alike (a projection, its reshape, then its RoPE are all `Qcur-3`): each is
compared, and the last one, the value it means by that name, counts; its suffixed views ("Qcur-3
(permuted)") are not compared.

A tensor's difference is `max |ours - llama.cpp|` and, relative to the tensor's scale, that divided by
`max |llama.cpp|` (an element-by-element ratio explodes wherever values cross zero). The first tensor, in
our graph's order, whose relative difference exceeds the tolerance is where the two graphs part.
"""

from __future__ import annotations

import argparse
import ctypes
import importlib.util
import json
import logging
import math
import re
import sys
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TextIO

import numpy as np

from ollama_engine.fs import GGUFFile
from ollama_engine.kvcache import Batch
from ollama_engine.ml import DType, GPULayers, TensorCapture
from ollama_engine.ml.device import default_threads, on_first_gpu
from ollama_engine.models import Model, load_model

TOLERANCE = 1e-3
"""Default relative tolerance. Both engines run the same ggml kernels, so a faithful graph differs by
rounding at most (on the real SmolLM2 Q4_1 every tensor is bitwise equal to llama.cpp's)."""

GENERATE = 8
NEEDS_LLAMA_CPP = ("diff needs llama.cpp's Python bindings: pip install llama-cpp-python==0.3.36 "
                   "(`python3 dev.py test` installs them)")
_NAME = re.compile(r"^([A-Za-z_][A-Za-z0-9_]*)(?:-(\d+))?$")  # llama.cpp's "attn_norm-3" or "result_norm"
_UNNAMED = re.compile(r"^(node|leaf)_\d+$")  # what ggml calls a graph's unnamed tensors: no meaning across graphs


@dataclass
class TensorDiff:
    """One tensor both engines named alike: its shape (ggml order) and the largest differences."""

    name: str
    layer: int | None  # None: outside the repeating layers (result_norm, result_output, inp_embd)
    shape: tuple[int, ...]
    llama_shape: tuple[int, ...]
    max_abs: float
    rel: float

    def over(self, tolerance: float) -> bool:
        return not self.rel <= tolerance  # NaN counts as over


@dataclass
class DiffResult:
    """Everything `diff` found: the tensors compared, the output's difference and both greedy choices."""

    model: str
    architecture: str
    tokens: list[int]
    llama_tokens: list[int]
    tolerance: float
    tensors: list[TensorDiff] = field(default_factory=list)  # in our graph's order
    output: str = "logits"  # or "embedding"
    output_max_abs: float = math.nan
    ours_argmax: list[int] = field(default_factory=list)  # per prompt position, then the greedy continuation
    llama_argmax: list[int] = field(default_factory=list)
    ours_only: list[str] = field(default_factory=list)  # names we give that llama.cpp's graph lacks
    missing: list[str] = field(default_factory=list)  # llama.cpp's names we give elsewhere but not there
    llama_only: list[str] = field(default_factory=list)  # llama.cpp's names (without "-N") we never give

    @property
    def first_over(self) -> TensorDiff | None:
        return next((t for t in self.tensors if t.over(self.tolerance)), None)

    @property
    def greedy_agree(self) -> bool:
        return self.ours_argmax == self.llama_argmax

    @property
    def departs(self) -> bool:
        return self.first_over is not None or not self.greedy_agree

    def to_json(self) -> dict:
        """Plain JSON: NaN and infinity (sizes that differ, non-finite values) become null."""
        first = self.first_over
        out = {**asdict(self), "first_over": None if first is None else asdict(first),
               "greedy_agree": self.greedy_agree, "departs": self.departs}
        return _finite(out)


def _finite(value):
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {key: _finite(v) for key, v in value.items()}
    if isinstance(value, list | tuple):
        return [_finite(v) for v in value]
    return value


def parse_layers(spec: str | None, block_count: int) -> set[int] | None:
    """'0-3,7' -> {0, 1, 2, 3, 7}; None: every layer."""
    if not spec:
        return None
    layers: set[int] = set()
    for part in spec.split(","):
        match = re.fullmatch(r"\s*(\d+)\s*(?:-\s*(\d+)\s*)?", part)
        if match is None:
            raise ValueError(f"--layers: {part!r} is not a layer number or a range like 2-5")
        first, last = int(match[1]), int(match[2] or match[1])
        if first > last or last >= block_count:
            raise ValueError(f"--layers: {part.strip()} is outside the model's layers 0-{block_count - 1}")
        layers.update(range(first, last + 1))
    return layers


def _selected(name: str, layers: set[int] | None) -> bool:
    match = _NAME.match(name)
    if match is None or _UNNAMED.match(name):
        return False
    return match[2] is None or layers is None or int(match[2]) in layers


def _ggml_shape(values: np.ndarray) -> tuple[int, ...]:
    """ggml's shape of captured values (numpy's reversed), without trailing dimensions of 1."""
    shape = list(reversed(values.shape))
    while len(shape) > 1 and shape[-1] == 1:
        shape.pop()
    return tuple(shape)


def _difference(name: str, ours: np.ndarray, theirs: np.ndarray) -> TensorDiff:
    layer = _NAME.match(name)[2]
    shape, llama_shape = _ggml_shape(ours), _ggml_shape(theirs)
    if ours.size != theirs.size:
        return TensorDiff(name, None if layer is None else int(layer), shape, llama_shape, math.nan, math.nan)
    ours, theirs = ours.ravel(), theirs.ravel()
    finite = np.isfinite(theirs)
    # infinities where both have the same one (deepseek2's masked expert groups: -inf) agree; NaN never does
    same_infinities = np.array_equal(np.isfinite(ours), finite) and np.array_equal(ours[~finite], theirs[~finite])
    ours, theirs = ours[finite], theirs[finite]
    with np.errstate(invalid="ignore", over="ignore"):
        max_abs = float(np.abs(ours - theirs).max(initial=0.0))
        scale = float(np.abs(theirs).max(initial=0.0))
    rel = max_abs / scale if scale > 0 else (0.0 if max_abs == 0 else math.inf)
    if not same_infinities:
        max_abs = rel = math.nan
    return TensorDiff(name, None if layer is None else int(layer), shape, llama_shape, max_abs, rel)


# ---------------------------------------------------------------- our engine


@dataclass
class _OursRun:
    architecture: str
    tokens: list[int]
    saved: dict[str, Path]  # name -> its values on disk, in the order the graph computed them
    named: set[str]  # every plain name our graph gives, in any layer, compared or not (integer tensors)
    output: Path  # logits (n, vocab) or embedding rows, on disk
    argmax: list[int]
    embedding: bool
    pooled: bool


def _gpu_layers(path: Path) -> list[GPULayers]:
    """Every layer, the output's included, on the first GPU (llama.cpp's default with a GPU)."""
    layout = on_first_gpu(GGUFFile.open(path).config.get_uint("block_count", 0) + 1)
    if not layout:
        raise ValueError("--gpu: this machine has no GPU that ggml can use")
    return layout


def _run_ours(path: Path, prompt: str, layers: str | None, generate: int, threads: int, flash: bool,
              folder: Path, gpu: bool = False) -> tuple[_OursRun, set[int] | None]:
    model = load_model(path, _gpu_layers(path) if gpu else [], num_threads=threads, flash_attention=flash)
    try:
        if model.tokenizer is None:
            raise ValueError(f"{path}: the model has no tokenizer")
        tokens = model.tokenizer.encode(prompt)
        if not tokens:
            raise ValueError("the prompt has no tokens")
        wanted_layers = parse_layers(layers, model.config.get_uint("block_count", 0))
        embedding = model.cache is None
        generate = 0 if embedding else generate
        context = model.config.get_uint("context_length", 0) or len(tokens) + generate
        if len(tokens) + generate > context:
            raise ValueError(f"{len(tokens)} prompt tokens and {generate} to generate exceed the model's "
                             f"context of {context}")
        model.backend.load()
        if model.cache is not None:
            model.cache.init(model.backend, DType.F16, 1, len(tokens) + generate, len(tokens))
        saved: dict[str, Path] = {}
        named: set[str] = set()

        def wanted(name: str) -> bool:
            if _NAME.match(name) is not None and not _UNNAMED.match(name):
                named.add(name)
            return _selected(name, wanted_layers)

        def take(name: str, values: np.ndarray) -> None:
            file = saved.setdefault(name, folder / f"ours-{len(saved)}.npy")
            np.save(file, values)

        n = len(tokens)
        batch = Batch(positions=np.arange(n), sequences=np.zeros(n), outputs=np.arange(n), tokens=tokens)
        with model.backend.eval_callback(TensorCapture(wanted, take)):
            logits = model.graphs.compute(batch)
        output = folder / "ours-output.npy"
        np.save(output, logits)
        argmax = [] if embedding else logits.argmax(axis=1).tolist()
        del logits
        argmax += _greedy(lambda token, position: _decode_ours(model, token, position), argmax[-1:], n, generate)
        run = _OursRun(model.config.architecture(), tokens, saved, named, output, argmax, embedding,
                       model.config.get_uint("pooling_type", 0) != 0)
        return run, wanted_layers
    finally:
        model.close()


def _decode_ours(model: Model, token: int, position: int) -> np.ndarray:
    return model.graphs.compute(Batch(positions=[position], sequences=[0], outputs=[0], tokens=[token]), copy=False)[0]


def _greedy(decode: Callable[[int, int], np.ndarray], last: list[int], position: int, n: int) -> list[int]:
    """n greedy tokens after the prompt whose last row chose last[0]; decode(token, position) -> logits."""
    out: list[int] = []
    token = last[0] if last else 0
    for step in range(n):
        out.append(token)
        if step + 1 < n:
            token = int(decode(token, position + step).argmax())
    return out


# ---------------------------------------------------------------- llama.cpp


class _LlamaCpp:
    """llama.cpp on one GGUF through its low-level API, with an eval callback on its scheduler."""

    def __init__(self, path: Path, n_ctx: int, n_batch: int, threads: int, flash: bool, embedding: bool,
                 capture: TensorCapture, verbose: bool, gpu: bool = False):
        import llama_cpp

        if not verbose:  # llama_cpp prints llama.cpp's logs unless this logger's level is above theirs
            logging.getLogger("llama-cpp-python").setLevel(logging.CRITICAL)
        self.lib = llama_cpp
        llama_cpp.llama_backend_init()
        model_params = llama_cpp.llama_model_default_params()
        model_params.n_gpu_layers = 999 if gpu else 0  # where ours runs: every layer on the GPU, or the CPU
        self.model = llama_cpp.llama_model_load_from_file(str(path).encode(), model_params)
        if not self.model:
            raise RuntimeError(f"llama.cpp could not load {path}")
        params = llama_cpp.llama_context_default_params()
        params.n_ctx = n_ctx
        params.n_batch = params.n_ubatch = n_batch
        params.n_seq_max = 1
        params.swa_full = False  # llama-server's default: a ring of n_swa + n_ubatch cells, as ours
        params.n_threads = params.n_threads_batch = threads
        params.flash_attn_type = 1 if flash else 0
        params.embeddings = embedding
        self._capture = capture  # ggml calls it as long as the context lives
        params.cb_eval = llama_cpp.ggml_backend_sched_eval_callback(capture.address)
        params.cb_eval_user_data = None
        self.ctx = llama_cpp.llama_init_from_model(self.model, params)
        if not self.ctx:
            llama_cpp.llama_model_free(self.model)
            raise RuntimeError("llama.cpp could not create its context")
        self.vocab = llama_cpp.llama_model_get_vocab(self.model)
        self.n_vocab = llama_cpp.llama_vocab_n_tokens(self.vocab)
        self.n_embd = llama_cpp.llama_model_n_embd(self.model)
        self.batch = llama_cpp.llama_batch_init(n_batch, 0, 1)

    def tokenize(self, text: str) -> list[int]:
        data = text.encode()
        size = len(data) + 8
        while True:
            buffer = (self.lib.llama_token * size)()
            n = self.lib.llama_tokenize(self.vocab, data, len(data), buffer, size, True, True)
            if n >= 0:
                return list(buffer[:n])
            size = -n  # too small: llama.cpp says how many it needs

    def decode(self, tokens: Sequence[int], start: int) -> None:
        batch = self.batch
        batch.n_tokens = len(tokens)
        for i, token in enumerate(tokens):
            batch.token[i], batch.pos[i], batch.n_seq_id[i], batch.logits[i] = token, start + i, 1, True
            batch.seq_id[i][0] = 0
        if self.lib.llama_decode(self.ctx, batch) != 0:
            raise RuntimeError("llama_decode failed")

    def _floats(self, pointer, rows: int, width: int) -> np.ndarray:
        if not pointer:
            raise RuntimeError("llama.cpp returned no output")
        data = ctypes.cast(pointer, ctypes.POINTER(ctypes.c_float))
        return np.ctypeslib.as_array(data, shape=(rows, width)).copy()

    def logits(self, rows: int) -> np.ndarray:
        return self._floats(self.lib.llama_get_logits(self.ctx), rows, self.n_vocab)

    def embeddings(self, rows: int, pooled: bool) -> np.ndarray:
        if pooled:
            return self._floats(self.lib.llama_get_embeddings_seq(self.ctx, 0), 1, self.n_embd)
        return self._floats(self.lib.llama_get_embeddings(self.ctx), rows, self.n_embd)

    def close(self) -> None:
        self.lib.llama_batch_free(self.batch)
        self.lib.llama_free(self.ctx)
        self.lib.llama_model_free(self.model)


def _normalized(rows: np.ndarray) -> np.ndarray:
    norms = np.linalg.norm(rows.astype(np.float64), axis=1, keepdims=True)
    return (rows / np.where(norms > 0, norms, 1.0)).astype(np.float32)


# ---------------------------------------------------------------- the comparison


def have_llama_cpp() -> bool:
    return importlib.util.find_spec("llama_cpp") is not None


def run_diff(path: str | Path, prompt: str, *, layers: str | None = None, tolerance: float = TOLERANCE,
             generate: int = GENERATE, threads: int | None = None, flash_attention: bool = False,
             verbose: bool = False, gpu: bool = False) -> DiffResult:
    """Run both engines on the prompt and compare every tensor both name (see the module's docstring)."""
    if not have_llama_cpp():
        raise RuntimeError(NEEDS_LLAMA_CPP)
    if tolerance <= 0 or generate < 0:
        raise ValueError("the tolerance must be positive and the tokens to generate not negative")
    path = Path(path)
    threads = threads or default_threads()
    with tempfile.TemporaryDirectory(prefix="ollama-engine-diff-") as tmp:
        folder = Path(tmp)
        ours, wanted_layers = _run_ours(path, prompt, layers, generate, threads, flash_attention, folder, gpu)
        generate = 0 if ours.embedding else generate
        result = DiffResult(model=path.name, architecture=ours.architecture, tokens=ours.tokens, llama_tokens=[],
                            tolerance=tolerance, output="embedding" if ours.embedding else "logits",
                            ours_argmax=ours.argmax)
        diffs: dict[str, TensorDiff] = {}
        llama_names: dict[str, None] = {}  # llama.cpp's plain names of the layers asked for, in its order
        capturing = [True]

        def wanted(name: str) -> bool:
            if not capturing[0]:
                return False
            if name in ours.saved:
                return True
            if _selected(name, wanted_layers):
                llama_names[name] = None
            return False

        def take(name: str, values: np.ndarray) -> None:
            diffs[name] = _difference(name, np.load(ours.saved[name]), values)  # the last one of a name counts

        n = len(ours.tokens)
        llama = _LlamaCpp(path, n + generate, n, threads, flash_attention, ours.embedding,
                          TensorCapture(wanted, take), verbose, gpu)
        try:
            result.llama_tokens = llama.tokenize(prompt)
            llama.decode(ours.tokens, 0)
            capturing[0] = False
            mine = np.load(ours.output)
            if ours.embedding:
                theirs = llama.embeddings(n, ours.pooled)
                if ours.pooled:
                    mine, theirs = _normalized(mine), _normalized(theirs)
            else:
                theirs = llama.logits(n)
                result.llama_argmax = theirs.argmax(axis=1).tolist()
            if mine.shape == theirs.shape:
                result.output_max_abs = float(np.abs(mine - theirs).max())
            del mine, theirs

            def decode(token: int, position: int) -> np.ndarray:
                llama.decode([token], position)
                return llama.logits(1)[0]

            result.llama_argmax += _greedy(decode, result.llama_argmax[-1:], n, generate)
        finally:
            llama.close()
    result.tensors = [diffs[name] for name in ours.saved if name in diffs]
    result.ours_only = [name for name in ours.saved if name not in diffs]
    bases = {_NAME.match(name)[1] for name in ours.named}
    result.missing = [name for name in llama_names if name not in ours.named and _NAME.match(name)[1] in bases]
    result.llama_only = sorted({_NAME.match(name)[1] for name in llama_names} - bases)
    return result


# ---------------------------------------------------------------- output


def _shape(shape: tuple[int, ...]) -> str:
    return "x".join(str(d) for d in shape)


def print_result(result: DiffResult, out: TextIO) -> None:
    first = result.first_over
    agree = "the same" if result.llama_tokens == result.tokens else f"llama.cpp's differ: {result.llama_tokens}"
    print(f"{result.model} ({result.architecture}): {len(result.tokens)} prompt tokens (llama.cpp's tokenizer: "
          f"{agree}); tolerance {result.tolerance:g} (max |ours - llama.cpp| / max |llama.cpp|)\n", file=out)
    print(f"{'layer':>5}  {'tensor':<18} {'shape':<14} {'max abs':>9} {'rel':>9}", file=out)
    for t in result.tensors:
        layer = "-" if t.layer is None else str(t.layer)
        shape = _shape(t.shape) if t.shape == t.llama_shape else f"{_shape(t.shape)}|{_shape(t.llama_shape)}"
        mark = "  <- first over tolerance" if t is first else ""
        if math.isnan(t.rel) and t.shape != t.llama_shape:
            mark += "  (sizes differ: ours|llama.cpp's)"
        base = _NAME.match(t.name)[1]
        print(f"{layer:>5}  {base:<18} {shape:<14} {t.max_abs:9.2e} {t.rel:9.2e}{mark}", file=out)
    if not result.tensors:
        print("  (no tensor named alike: name the model's tensors as llama.cpp does, see models/base.py)", file=out)
    print(file=out)
    if first is None:
        print(f"every compared tensor is within the tolerance ({len(result.tensors)} tensors)", file=out)
    else:
        where = "outside the layers" if first.layer is None else f"layer {first.layer}"
        print(f"first departure: {where}, {first.name} (relative difference {first.rel:.2e})", file=out)
    n = len(result.tokens)
    print(f"{result.output}: largest difference {result.output_max_abs:.2e}", file=out)
    if result.output == "logits":
        same = sum(a == b for a, b in zip(result.ours_argmax[:n], result.llama_argmax[:n], strict=False))
        print(f"greedy: the next token agrees at {same} of {n} prompt positions", file=out, end="")
        ours, theirs = result.ours_argmax[n:], result.llama_argmax[n:]
        step = next((i for i, (a, b) in enumerate(zip(ours, theirs, strict=False)) if a != b), None)
        if step is None:
            print(f"; {len(ours)} generated tokens agree {ours}", file=out)
        else:
            print(f"; generated tokens part at step {step}: ours {ours}, llama.cpp {theirs}", file=out)
    if result.missing:
        print(f"in llama.cpp's graph, not in ours: {', '.join(result.missing)}", file=out)
    if result.ours_only:
        print(f"named by us, absent from llama.cpp's graph: {', '.join(result.ours_only)}", file=out)
    if result.llama_only:
        print(f"llama.cpp also names (name ours alike to compare them): {', '.join(result.llama_only)}", file=out)


def add_diff_command(subparsers: argparse._SubParsersAction) -> None:
    diff = subparsers.add_parser("diff", help="compare a model's tensors with llama.cpp's, layer by layer")
    diff.add_argument("model", help="a GGUF file")
    diff.add_argument("--prompt", required=True)
    diff.add_argument("--layers", help="only these layers, e.g. 0-3,29 (default: all); bounds the temporary files")
    diff.add_argument("--tolerance", type=float, default=TOLERANCE,
                      help=f"largest relative difference (default {TOLERANCE:g})")
    diff.add_argument("-n", "--generate", type=int, default=GENERATE,
                      help=f"greedy tokens to generate and compare after the prompt (default {GENERATE})")
    diff.add_argument("--threads", type=int, default=0, help="threads for both engines (default: all cores)")
    diff.add_argument("--flash-attention", action="store_true", help="both engines with flash attention")
    diff.add_argument("--gpu", action="store_true", help="both engines with every layer on the first GPU")
    diff.add_argument("--json", action="store_true", help="print one JSON object")
    diff.set_defaults(run=run_diff_command)


def run_diff_command(args: argparse.Namespace) -> int:
    """Print the comparison; 1 when the engines depart (a tensor over tolerance, or greedy tokens differ)."""
    result = run_diff(args.model, args.prompt, layers=args.layers, tolerance=args.tolerance,
                      generate=args.generate, threads=args.threads or None, flash_attention=args.flash_attention,
                      verbose=args.verbose, gpu=args.gpu)
    if args.json:
        json.dump(result.to_json(), sys.stdout, indent=1)
        print()
    else:
        print_result(result, sys.stdout)
    return 1 if result.departs else 0

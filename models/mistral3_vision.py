"""Mistral 3's vision tower: Pixtral (llama.cpp's tools/mtmd/models/pixtral.cpp, PROJECTOR_TYPE_PIXTRAL;
Ollama's mistral3/model_vision.go and model.go).

A ViT with RMS norms, a SwiGLU feed-forward and 2-D RoPE (a patch's row turns the first half of each head,
its column the second half) at the image's own resolution: the image is resized, keeping its aspect ratio,
to sides that are multiples of patch x merge and to between 8 and 1024 output tokens (llama.cpp's
dyn_size preprocessing, bicubic; Ollama's Go engine fitted the longest side into 1540 pixels and rounded to
the patch only — we follow llama.cpp). Mistral Small 3.1+ then RMS-norms the patches and merges each 2 x 2
square into one (the patch merger: an unfold and a matrix), and a two-layer GELU projector maps them to
the text width. The embedding of [IMG_BREAK] ends every row of merged patches but the last, inside the
tower's output as llama.cpp's graph puts it; the text [IMG_END] follows the image.

Ollama's single file has no copy of [IMG_BREAK]'s embedding: it is the text model's token_embd row of that
token (id 12 in Mistral's vocabulary, which Ollama's runner inserts as a text token), read from the file
and dequantized by ggml's get_rows as the text model's own lookup would.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ollama_engine.image import DecodedImage, Filter, ImageError, PixelSpec, fit_box, size_preserved_ratio, to_planar
from ollama_engine.ml import Backend, Context, DType, Tensor

from .base import ModelError, bind, weight
from .vision import VisionModel, register_vision
from .vit import ViTLayer, ViTOptions, linear, patch_embedding, rope_2d, vit_block

MIN_TOKENS, MAX_TOKENS = 8, 1024  # clip.cpp's set_limit_image_tokens(8, 1024) for Pixtral
ROPE_BASE = 10000.0  # clip.cpp fixes it for Pixtral; Ollama's file may say vision.rope.freq_base
IMG_BREAK_ID = 12  # Ollama's fixed id of [IMG_BREAK] where the vocabulary does not name it
CLIP_DEFAULTS = PixelSpec((0.48145466, 0.4578275, 0.40821073), (0.26862954, 0.26130258, 0.27577711))


@dataclass
class PixtralWeights:
    patch_embd: Tensor = weight("v.patch_embd.weight")
    patch_bias: Tensor | None = weight("v.patch_embd.bias", optional=True)
    pre_ln: Tensor | None = weight("v.pre_ln.weight", optional=True)
    input_norm: Tensor | None = weight("mm.input_norm.weight", optional=True)  # Mistral Small 3.1+
    patch_merger: Tensor | None = weight("mm.patch_merger.weight", optional=True, matrix=True)
    mm_1: Tensor = weight("mm.1.weight", matrix=True)
    mm_1_b: Tensor | None = weight("mm.1.bias", optional=True)
    mm_2: Tensor = weight("mm.2.weight", matrix=True)
    mm_2_b: Tensor | None = weight("mm.2.bias", optional=True)
    img_break: Tensor | None = weight("v.token_embd.img_break", optional=True)  # mmproj only


@register_vision
class PixtralVision(VisionModel):
    """The tower of a llama.cpp mmproj (clip.projector_type "pixtral")."""

    projector = "pixtral"
    image_end = "[IMG_END]"
    DEFAULT_PIXELS = CLIP_DEFAULTS
    OLLAMA_NAMES = {  # noqa: RUF012 - read only
        "v.patch_embd": "v.patch_conv", "v.pre_ln": "v.encoder_norm", ".ln1.": ".attn_norm.",
        ".ln2.": ".ffn_norm.", ".attn_out.": ".attn_output.", "mm.input_norm": "mm.norm",
        "mm.patch_merger.weight": "mm.patch_merger.merging_layer.weight", "mm.1.": "mm.linear_1.",
        "mm.2.": "mm.linear_2.",
    }

    def __init__(self, backend: Backend):
        super().__init__(backend)
        path, c = backend.model.path, self.config
        self.w = bind(PixtralWeights, self.weights)  # type: ignore[arg-type]
        self.layers = [bind(ViTLayer, self.weights, f"v.blk.{i}.") for i in range(self.n_layer)]  # type: ignore[arg-type]
        if self.layout == "mmproj":
            self.merge = c.get_uint("vision.spatial_merge_size", 1)
            self.rope_base = ROPE_BASE
            self.merger_eps = self.eps
        else:  # Ollama's keys and defaults (model_vision.go, model.go)
            self.merge = c.get_uint("spatial_merge_size", 2)
            self.eps = c.get_float("vision.attention.layer_norm_epsilon", 1e-5)
            self.rope_base = c.get_float("vision.rope.freq_base", ROPE_BASE)
            self.merger_eps = c.get_float("text_config.rms_norm_eps", 1e-5)
        self.head_dim = self.n_embd // self.n_head
        if self.head_dim % 4 or c.get_uint("vision.attention.key_length", self.head_dim) != self.head_dim:
            raise ModelError(f"{path}: vision heads of {self.head_dim} (width {self.n_embd}, {self.n_head} heads) "
                             "need a size divisible by 4 and equal to vision.attention.key_length")
        if self.merge < 1 or (self.w.patch_merger is None and self.merge != 1):
            raise ModelError(f"{path}: spatial merge {self.merge} needs a patch merger (mm.patch_merger)")
        merged = (self.n_embd * self.merge**2, self.n_embd)
        if self.w.patch_merger is not None and (self.w.input_norm is None or self.w.patch_merger.shape[:2] != merged):
            raise ModelError(f"{path}: patch merger {self.w.patch_merger.shape} for width {self.n_embd} merged "
                             f"{self.merge} x {self.merge}, with the input norm (mm.input_norm)")
        if self.w.patch_embd.shape != (self.patch_size, self.patch_size, 3, self.n_embd):
            raise ModelError(f"{path}: patch embedding {self.w.patch_embd.shape} for {self.patch_size}-pixel "
                             f"patches of width {self.n_embd}")
        self.break_row = self._img_break_row() if self.w.img_break is None else None
        if self.w.img_break is not None and self.w.img_break.shape != (self.text_embd,):
            raise ModelError(f"{path}: [IMG_BREAK] embedding {self.w.img_break.shape} for text width {self.text_embd}")
        gelu = self.layout == "mmproj" and c.get_bool("use_gelu") and not c.get_bool("use_silu")
        if self.layout == "mmproj" and not (gelu or c.get_bool("use_silu")):
            raise ModelError(f"{path}: a Pixtral tower's feed-forward is SiLU (clip.use_silu) or GELU (clip.use_gelu)")
        self.options = ViTOptions(self.n_embd, self.n_head, self.eps, backend.flash_attention,
                                  activation=Tensor.gelu if gelu else Tensor.silu, rms_norm=True)
        area = (self.patch_size * self.merge) ** 2
        self.min_pixels, self.max_pixels = MIN_TOKENS * area, MAX_TOKENS * area

    def _img_break_row(self) -> tuple[DType, np.ndarray]:
        """Ollama's file: the raw bytes of token_embd's [IMG_BREAK] row (any type ggml reads) and that type."""
        model = self.backend.model
        info = model.tensors.get("token_embd.weight")
        if info is None or len(info.shape) != 2 or info.shape[0] != self.text_embd:
            raise ModelError(f"{model.path}: no token_embd.weight of width {self.text_embd} to take [IMG_BREAK] from")
        tokens = self.config.get_strings("tokenizer.ggml.tokens")
        token = tokens.index("[IMG_BREAK]") if "[IMG_BREAK]" in tokens else IMG_BREAK_ID
        if token >= info.shape[1]:
            raise ModelError(f"{model.path}: [IMG_BREAK] (token {token}) is past token_embd's {info.shape[1]} rows")
        row = info.n_bytes // info.shape[1]
        return DType(info.file_type), np.array(model.tensor_data(info.name)[token * row : (token + 1) * row])

    @property
    def text_embd(self) -> int:
        return self.w.mm_2.ne[1]

    def size(self, image: DecodedImage) -> tuple[int, int]:
        """The (width, height) the image is resized to (clip.cpp's dyn_size preprocessing). An image so narrow
        that its short side stays at one grid cell while the long one is scaled for the pixel budget ends up
        above the budget (llama.cpp encodes it so); its graph would outgrow the one reserved at load, so it is
        refused instead."""
        height, width = image.pixels.shape[:2]
        size = size_preserved_ratio(width, height, self.patch_size * self.merge, self.min_pixels, self.max_pixels)
        if size[0] * size[1] > self.max_pixels:
            raise ImageError(f"image of {width}x{height} is too narrow for this model: its aspect ratio would need "
                             f"{size[0]}x{size[1]} pixels, more than {self.max_pixels}")
        return size

    def tokens(self, image: DecodedImage) -> int:
        width, height = self.size(image)
        across, down = width // self.patch_size // self.merge, height // self.patch_size // self.merge
        return across * down + down - 1  # one [IMG_BREAK] after each row but the last

    def pixels(self, image: DecodedImage) -> np.ndarray:
        width, height = self.size(image)
        return to_planar(fit_box(image.pixels, width, height, Filter.BICUBIC), self.pixel_spec)

    def reserve(self) -> None:
        """The largest image graph: a square of MAX_TOKENS merged patches (the most patches any shape has)."""
        side = int(np.sqrt(self.max_pixels))
        ctx, _, out = self._graph_for((3, side, side))
        ctx.reserve(out)

    def build(self, ctx: Context, pixels: Tensor) -> Tensor:
        w, o, m = self.w, self.options, self.merge
        across, down = pixels.ne[0] // self.patch_size, pixels.ne[1] // self.patch_size
        index = np.arange(across * down, dtype=np.int32)
        pos_h = ctx.input().from_numpy(index // across).set_name("pos_h")
        pos_w = ctx.input().from_numpy(index % across).set_name("pos_w")

        def add_pos(x: Tensor) -> Tensor:
            return rope_2d(x, pos_h, pos_w, self.rope_base, interleave_freq=True)

        x = patch_embedding(w.patch_embd, w.patch_bias, pixels, self.patch_size)
        if w.pre_ln is not None:
            x = x.rms_norm(w.pre_ln, self.eps)
        for i, layer in enumerate(self.layers):
            x = vit_block(layer, x, o, add_pos).set_name(f"layer_out-{i}")
        if w.patch_merger is not None:  # each m x m square of patches unfolded into one column, then projected
            x = x.rms_norm(w.input_norm, self.merger_eps)
            grid = x.reshape(self.n_embd, across, down).permute(2, 0, 1, 3).contiguous()  # (across, down, n_embd)
            kernel = grid.view(0, (m, m, self.n_embd), (0, 0))  # only its shape is read
            x = kernel.im2col(grid, m)
            x = w.patch_merger.matmul(x.reshape(x.ne[0], x.ne[1] * x.ne[2]))
        x = linear(w.mm_2, w.mm_2_b, linear(w.mm_1, w.mm_1_b, x).gelu())
        return self._with_breaks(ctx, x, across // m, down // m).set_name("mm_out")

    def _with_breaks(self, ctx: Context, x: Tensor, across: int, down: int) -> Tensor:
        """(text_embd, across * down) -> each row of `across` followed by [IMG_BREAK], the last row's dropped."""
        n = self.text_embd
        if self.w.img_break is not None:
            brk = self.w.img_break.in_graph(ctx).reshape(n, 1, 1)
        else:
            assert self.break_row is not None
            dtype, raw = self.break_row
            table = ctx.input().from_bytes(dtype, raw, n, 1)
            brk = table.rows(ctx.input().from_numpy(np.zeros(1, dtype=np.int32))).reshape(n, 1, 1)
        rows = x.reshape(n, across, down).concat(brk.repeat_to(n, 1, down), 1)  # (n, across + 1, down)
        tokens = across * down + down - 1
        return rows.view(0, (n, tokens), (rows.strides[1],)).contiguous()


@register_vision
class Mistral3Vision(PixtralVision):
    """The same tower in Ollama's single file beside a mistral3 text model."""

    projector = "mistral3"

"""Qwen2.5-VL's vision tower (llama.cpp's tools/mtmd/models/qwen2vl.cpp, PROJECTOR_TYPE_QWEN25VL; Ollama's
qwen25vl/model_vision.go).

The image is resized, keeping its aspect ratio, to sides that are multiples of patch x 2 and to between 8 and
2674 output tokens (llama.cpp's dyn_size preprocessing, bicubic, as Pixtral's). llama.cpp allows 4096 tokens,
whose worst-case graph is too large to reserve at load (16 384 patches attending to each other); we cap images
as Ollama's Go engine did, at 2 << 20 pixels (qwen25vl/process_image.go's vision.max_pixels default), in
llama.cpp's arithmetic: mtmd with image_max_tokens 2674 resizes every image as we do. Patches are embedded by two
kernels, one per frame of Qwen's temporal patch, both reading the same still image (llama.cpp's
n_batch == 1 path), and reordered so each 2 x 2 square of patches is contiguous. The blocks are RMS-normed
SwiGLU blocks with biases; queries and keys are turned by ggml's VISION RoPE over (row, column, row, column)
of each patch; every n_wa_pattern-th layer attends to all patches, the others only within windows of
window_size pixels (the patches regrouped window by window, a block-diagonal mask). A final RMS norm, then
each 2 x 2 square is merged by a GELU MLP into one text embedding, and the windows' order undone.

The output is a grid (rows, columns, text n_embd) of merged patches: the runner gives its rows the text
model's multimodal RoPE positions (runner/positions.py), between <|vision_start|> and <|vision_end|>.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ollama_engine.image import DecodedImage, Filter, PixelSpec, fit_box, size_preserved_ratio, to_planar
from ollama_engine.ml import Backend, Context, RopeOptions, Tensor

from .base import ModelError, bind, weight
from .vision import VisionModel, register_vision
from .vit import ViTLayer, ViTOptions, linear, vit_block

MIN_TOKENS = 8  # clip.cpp's set_limit_image_tokens(8, 4096) for Qwen2/2.5-VL (we keep its floor)
MAX_PIXELS = 2 << 20  # Ollama's cap (vision.max_pixels in its file, else 2 M), instead of clip.cpp's 4096 tokens
MERGE = 2  # merged squares of 2 x 2 patches (clip.cpp's default n_merge; the graph assumes 2)
WINDOW = 112  # the attention window in pixels (clip.cpp's fixed value; Ollama's default)
ROPE_BASE = 10000.0  # clip.cpp's ggml_rope_multi arguments for the tower
ROPE_CONTEXT = 32768
ROPE_OPTIONS = RopeOptions(neox=False, original_context=ROPE_CONTEXT, extrapolation_factor=0.0,
                           attention_factor=1.0, beta_fast=32.0, beta_slow=1.0)
"""clip.cpp's ggml_rope_multi arguments for the tower: no YaRN, context 32768, betas 32 and 1."""
QWEN_PIXELS = PixelSpec((0.48145466, 0.4578275, 0.40821073), (0.26862954, 0.26130258, 0.27577711))


@dataclass
class Qwen25VLWeights:
    patch_embd: Tensor = weight("v.patch_embd.weight")
    patch_embd_1: Tensor = weight("v.patch_embd.weight.1")
    post_ln: Tensor = weight("v.post_ln.weight")
    mm_0: Tensor = weight("mm.0.weight", matrix=True)
    mm_0_b: Tensor = weight("mm.0.bias")
    mm_2: Tensor = weight("mm.2.weight", matrix=True)
    mm_2_b: Tensor = weight("mm.2.bias")


def window_order(rows: int, cols: int, window: int) -> tuple[np.ndarray, np.ndarray]:
    """The merged patches (rows x cols, raster order) regrouped window by window (window x window merged
    patches, the last ones cut by the edges): (order, windows), order[k] the raster index of the k-th
    regrouped patch, windows[k] its window's number (clip.cpp's inv_window_idx and its mask's blocks)."""
    order: list[int] = []
    windows: list[int] = []
    for y in range(0, rows, window):
        for x in range(0, cols, window):
            number = len(set(windows))
            for dy in range(min(window, rows - y)):
                for dx in range(min(window, cols - x)):
                    order.append((y + dy) * cols + x + dx)
                    windows.append(number)
    return np.asarray(order, dtype=np.int32), np.asarray(windows, dtype=np.int32)


@register_vision
class Qwen25VLVision(VisionModel):
    """The tower of a llama.cpp mmproj (clip.projector_type "qwen2.5vl_merger")."""

    projector = "qwen2.5vl_merger"
    image_begin = "<|vision_start|>"
    image_end = "<|vision_end|>"
    DEFAULT_PIXELS = QWEN_PIXELS
    OLLAMA_NAMES = {  # noqa: RUF012 - read only
        "v.patch_embd.weight.1": "v.patch_embd_1.weight", "v.patch_embd.weight": "v.patch_embd_0.weight",
        "v.post_ln.": "v.merger.ln_q.", "mm.0.": "v.merger.mlp.0.", "mm.2.": "v.merger.mlp.2.",
    }

    def __init__(self, backend: Backend):
        super().__init__(backend)
        path, c = backend.model.path, self.config
        self.w = bind(Qwen25VLWeights, self.weights)  # type: ignore[arg-type]
        self.layers = [bind(ViTLayer, self.weights, f"v.blk.{i}.") for i in range(self.n_layer)]  # type: ignore[arg-type]
        merge = c.get_uint("vision.spatial_merge_size", MERGE)
        window = WINDOW  # clip.cpp reads no window size for Qwen2.5-VL
        if self.layout == "mmproj":
            pattern = c.get_uint("vision.n_wa_pattern", 0)
            if pattern < 1:
                raise ModelError(f"{path}: a Qwen2.5-VL tower needs clip.vision.n_wa_pattern (its full-attention "
                                 "layers' period)")
            self.full = frozenset(i for i in range(self.n_layer) if (i + 1) % pattern == 0)
        else:  # Ollama's keys and defaults (model_vision.go)
            window = c.get_uint("vision.window_size", WINDOW)
            self.full = frozenset(c.get_ints("vision.fullatt_block_indexes") or (7, 15, 23, 31))
            if c.get_float("vision.rope.freq_base", ROPE_BASE) != ROPE_BASE:
                raise ModelError(f"{path}: vision.rope.freq_base other than {ROPE_BASE} is not supported")
        self.head_dim = self.n_embd // self.n_head
        if merge != MERGE or self.head_dim % 4:
            raise ModelError(f"{path}: a Qwen2.5-VL tower merges 2 x 2 patches (not {merge}) and needs heads of a "
                             f"size divisible by 4 (not {self.head_dim})")
        if window % (self.patch_size * MERGE):
            raise ModelError(f"{path}: attention window {window} is not a multiple of patch x merge "
                             f"{self.patch_size * MERGE}")
        self.window = window // (self.patch_size * MERGE)  # in merged patches
        kernel = (self.patch_size, self.patch_size, 3, self.n_embd)
        if self.w.patch_embd.shape != kernel or self.w.patch_embd_1.shape != kernel:
            raise ModelError(f"{path}: patch embeddings {self.w.patch_embd.shape} and {self.w.patch_embd_1.shape} "
                             f"for {self.patch_size}-pixel patches of width {self.n_embd}")
        merged = self.n_embd * MERGE * MERGE
        if self.w.mm_0.shape[:2] != (merged, merged) or self.w.mm_2.shape[0] != merged:
            raise ModelError(f"{path}: merger {self.w.mm_0.shape}, {self.w.mm_2.shape} for width {self.n_embd} "
                             "merged 2 x 2")
        self.options = ViTOptions(self.n_embd, self.n_head, self.eps, backend.flash_attention,
                                  activation=Tensor.silu, rms_norm=True)
        area = (self.patch_size * MERGE) ** 2
        max_pixels = MAX_PIXELS if self.layout == "mmproj" else c.get_uint("vision.max_pixels", MAX_PIXELS)
        self.max_tokens = max_pixels // area  # whole tokens, as mtmd's image_max_tokens sets its limit
        if self.max_tokens < MIN_TOKENS:
            raise ModelError(f"{path}: vision.max_pixels {max_pixels} is under {MIN_TOKENS} tokens of {area} pixels")
        self.min_pixels, self.max_pixels = MIN_TOKENS * area, self.max_tokens * area

    @property
    def text_embd(self) -> int:
        return self.w.mm_2.ne[1]

    def size(self, image: DecodedImage) -> tuple[int, int]:
        """The (width, height) the image is resized to (clip.cpp's dyn_size preprocessing)."""
        height, width = image.pixels.shape[:2]
        return size_preserved_ratio(width, height, self.patch_size * MERGE, self.min_pixels, self.max_pixels)

    def grid(self, image: DecodedImage) -> tuple[int, int]:
        """(rows, columns) of merged patches the image becomes."""
        width, height = self.size(image)
        return height // self.patch_size // MERGE, width // self.patch_size // MERGE

    def tokens(self, image: DecodedImage) -> int:
        rows, cols = self.grid(image)
        return rows * cols

    def pixels(self, image: DecodedImage) -> np.ndarray:
        width, height = self.size(image)
        return to_planar(fit_box(image.pixels, width, height, Filter.BICUBIC), self.pixel_spec)

    def encode_chunks(self, image: DecodedImage) -> list[np.ndarray]:
        """One chunk shaped as its grid (rows, columns, text n_embd): its rows get 2-D text positions."""
        rows, cols = self.grid(image)
        return [self.encode(image).reshape(rows, cols, self.text_embd)]

    def reserve(self) -> None:
        """The largest image graph: max_tokens merged patches (every tensor's size depends on the count only),
        as the most nearly square grid of them."""
        rows = max(r for r in range(1, int(np.sqrt(self.max_tokens)) + 1) if self.max_tokens % r == 0)
        side = self.patch_size * MERGE
        ctx, _, out = self._graph_for((3, rows * side, self.max_tokens // rows * side))
        ctx.reserve(out)

    def build(self, ctx: Context, pixels: Tensor) -> Tensor:
        w, o, p, n = self.w, self.options, self.patch_size, self.n_embd
        across, down = pixels.ne[0] // p, pixels.ne[1] // p
        cols, rows = across // MERGE, down // MERGE
        x = w.patch_embd.conv2d(pixels, p).add(w.patch_embd_1.conv2d(pixels, p))  # (across, down, n_embd, 1)
        # each 2 x 2 square of patches contiguous, squares in raster order (clip.cpp's "second conv dimension")
        x = x.permute(1, 2, 0, 3).contiguous(n * 2, cols, down)
        x = x.reshape(n * 2, cols, 2, rows).permute(0, 2, 1, 3).contiguous(n, across * down)
        order, windows = window_order(rows, cols, self.window)
        made = ctx.input()
        x = x.reshape(n * 4, rows * cols).rows(made.from_numpy(order).set_name("inv_window_idx")).reshape(n, -1)
        positions = made.from_numpy(self._positions(order, cols)).set_name("positions")
        patch_windows = np.repeat(windows, MERGE * MERGE)
        mask = np.where(patch_windows[:, None] == patch_windows[None, :], 0.0, -np.inf).astype(np.float32)
        window_mask = made.from_numpy(mask).set_name("window_mask")
        sections = [self.head_dim // 4] * 4

        def add_pos(t: Tensor) -> Tensor:
            return t.rope_multi(positions, self.head_dim // 2, sections, ROPE_BASE, ROPE_OPTIONS, vision=True)

        for i, layer in enumerate(self.layers):
            x = vit_block(layer, x, o, add_pos, None if i in self.full else window_mask).set_name(f"layer_out-{i}")
        x = x.rms_norm(w.post_ln, self.eps)
        x = linear(w.mm_2, w.mm_2_b, linear(w.mm_0, w.mm_0_b, x.reshape(n * 4, rows * cols)).gelu())
        restore = made.from_numpy(np.argsort(order).astype(np.int32)).set_name("window_idx")
        return x.rows(restore).set_name("mm_out")

    @staticmethod
    def _positions(order: np.ndarray, cols: int) -> np.ndarray:
        """(4 * patches) I32, component-major: row, column, row, column of each patch in the regrouped order
        (clip.cpp's positions for QWEN25VL)."""
        square = np.repeat(order, MERGE * MERGE)  # the merged patch each patch belongs to
        dy = np.tile(np.array([0, 0, 1, 1], dtype=np.int32), len(order))
        dx = np.tile(np.array([0, 1, 0, 1], dtype=np.int32), len(order))
        y = (square // cols) * MERGE + dy
        x = (square % cols) * MERGE + dx
        return np.concatenate([y, x, y, x]).astype(np.int32)


@register_vision
class Qwen25VLOllamaVision(Qwen25VLVision):
    """The same tower in Ollama's single file beside a qwen25vl text model."""

    projector = "qwen25vl"

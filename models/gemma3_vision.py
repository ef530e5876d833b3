"""Gemma 3's vision tower: SigLIP, average-pooled to 256 tokens, RMS-normed and projected to the text
width (llama.cpp's tools/mtmd/models/siglip.cpp, PROJECTOR_TYPE_GEMMA3; Ollama's gemma3/model_vision.go).

The image is fitted into the tower's square keeping its aspect ratio, bilinear, padded with black
(llama.cpp's fixed-size preprocessing; Ollama's Go engine stretched it to the square instead). The text
model lets the image's tokens attend to each other both ways.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from ollama_engine.image import DecodedImage, Filter, fit_square, to_planar
from ollama_engine.ml import Backend, Context, Tensor

from .base import ModelError, bind, weight
from .vision import VisionModel, register_vision
from .vit import ViTLayer, ViTOptions, patch_embedding, vit_block


@dataclass
class SigLIPWeights:
    patch_embd: Tensor = weight("v.patch_embd.weight")
    patch_bias: Tensor | None = weight("v.patch_embd.bias", optional=True)
    position_embd: Tensor = weight("v.position_embd.weight", matrix=True)
    post_ln: Tensor | None = weight("v.post_ln.weight", optional=True)
    post_ln_b: Tensor | None = weight("v.post_ln.bias", optional=True)
    soft_emb_norm: Tensor = weight("mm.soft_emb_norm.weight")
    input_projection: Tensor = weight("mm.input_projection.weight", matrix=True)


@register_vision
class Gemma3Vision(VisionModel):
    projector = "gemma3"
    non_causal = True
    image_begin, image_end = "<start_of_image>", "<end_of_image>"
    OLLAMA_NAMES = {  # noqa: RUF012 - read only
        "v.patch_embd": "v.patch_embedding", "v.position_embd": "v.position_embedding",
        "v.post_ln": "v.post_layernorm", ".attn_out.": ".attn_output.", ".ln1.": ".layer_norm1.",
        ".ln2.": ".layer_norm2.", ".ffn_up.": ".mlp.fc1.", ".ffn_down.": ".mlp.fc2.",
        "mm.input_projection": "mm.mm_input_projection", "mm.soft_emb_norm": "mm.mm_soft_emb_norm",
    }

    def __init__(self, backend: Backend):
        super().__init__(backend)
        self.w = bind(SigLIPWeights, self.weights)  # type: ignore[arg-type]
        self.layers = [bind(ViTLayer, self.weights, f"v.blk.{i}.") for i in range(self.n_layer)]  # type: ignore[arg-type]
        for layer in self.layers:
            layer.swap_legacy_ffn(self.n_embd)
        side = self.image_size // self.patch_size
        if self.layout == "mmproj":
            self.merge = self.config.get_uint("vision.projector.scale_factor", 4)
        else:  # Ollama's: mm_tokens_per_image, a square number
            tokens = self.config.get_uint("mm_tokens_per_image", 256)
            per_side = math.isqrt(tokens)
            self.merge = side // per_side if per_side and per_side * per_side == tokens else 0
        if not self.merge or side % self.merge:
            raise ModelError(f"{backend.model.path}: {side} patches a side do not pool by {self.merge}")
        if self.w.position_embd.shape[:2] != (self.n_embd, side * side):
            raise ModelError(f"{backend.model.path}: position embeddings {self.w.position_embd.shape} for "
                             f"{side * side} patches of width {self.n_embd}")
        self.options = ViTOptions(self.n_embd, self.n_head, self.eps, backend.flash_attention)

    @property
    def text_embd(self) -> int:
        return self.w.input_projection.ne[0]

    def tokens(self, image: DecodedImage) -> int:
        return (self.image_size // self.patch_size // self.merge) ** 2

    def pixels(self, image: DecodedImage) -> np.ndarray:
        return to_planar(fit_square(image.pixels, self.image_size, Filter.BILINEAR), self.pixel_spec)

    def build(self, ctx: Context, pixels: Tensor) -> Tensor:
        side = pixels.ne[0] // self.patch_size
        x = patch_embedding(self.w.patch_embd, self.w.patch_bias, pixels, self.patch_size)
        x = x.add(self.w.position_embd)
        for i, layer in enumerate(self.layers):
            x = vit_block(layer, x, self.options).set_name(f"layer_out-{i}")
        if self.w.post_ln is not None:
            x = x.layer_norm(self.w.post_ln, self.w.post_ln_b, self.eps)
        # average-pool the side x side grid of patches by merge x merge squares
        grid = x.transpose().contiguous(side, side, self.n_embd)
        pooled = grid.avg_pool2d(self.merge)
        pooled = pooled.reshape(pooled.ne[0] * pooled.ne[1], self.n_embd).transpose().contiguous()
        pooled = pooled.rms_norm(self.w.soft_emb_norm, self.eps)
        projection = self.w.input_projection.in_graph(ctx).transpose().contiguous()
        return projection.matmul(pooled).set_name("mm_out")

"""Llama 4's vision tower (Scout, Maverick): a ViT with a class token and 2-D RoPE, pixel shuffle, a GELU
MLP adapter and the projection into the text model (llama.cpp's tools/mtmd/models/llama4.cpp,
PROJECTOR_TYPE_LLAMA4; Ollama's llama4/model_vision.go for its single-file names).

An image becomes tiles of image_size a side and a thumbnail (ollama_engine/image/llama4.py), each encoded
alone by the same graph into its own chunk of embeddings, decoded by the text model as mtmd's chunks:
<|image_start|>, the tiles' chunks row by row, the thumbnail's, <|image_end|>. The text model reads them
causally, as any token.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ollama_engine.image import DecodedImage, to_planar
from ollama_engine.image.llama4 import tile_count, tiles
from ollama_engine.ml import Backend, Context, DType, Tensor

from .base import ModelError, bind, weight
from .vision import VisionModel, register_vision
from .vit import ViTLayer, ViTOptions, rope_2d, vit_block

ROPE_THETA = 10000.0  # clip.cpp fixes it for llama4 (Ollama's file says so in vision.rope.freq_base)


@dataclass
class Llama4VisionWeights:
    patch_embd: Tensor = weight("v.patch_embd.weight")  # (3 * patch * patch, n_embd): an unfolding linear
    class_embd: Tensor = weight("v.class_embd")
    position_embd: Tensor = weight("v.position_embd.weight", matrix=True)
    pre_ln: Tensor = weight("v.pre_ln.weight")
    pre_ln_b: Tensor | None = weight("v.pre_ln.bias", optional=True)
    post_ln: Tensor = weight("v.post_ln.weight")
    post_ln_b: Tensor | None = weight("v.post_ln.bias", optional=True)
    mlp_1: Tensor = weight("mm.model.mlp.1.weight")
    mlp_2: Tensor = weight("mm.model.mlp.2.weight")
    projection: Tensor = weight("mm.model.fc.weight")


@register_vision
class Llama4Vision(VisionModel):
    projector = "llama4"
    image_begin, image_end = "<|image_start|>", "<|image_end|>"
    OLLAMA_NAMES = {  # noqa: RUF012 - read only
        "v.patch_embd": "v.patch_embedding", "v.class_embd": "v.class_embedding",
        "v.position_embd.weight": "v.positional_embedding_vlm", "v.pre_ln": "v.layernorm_pre",
        "v.post_ln": "v.layernorm_post", ".attn_out.": ".attn_output.", ".ln1.": ".attn_norm.",
        ".ln2.": ".ffn_norm.", ".ffn_up.": ".mlp.fc1.", ".ffn_down.": ".mlp.fc2.",
        "mm.model.mlp.1": "v.vision_adapter.mlp.fc1", "mm.model.mlp.2": "v.vision_adapter.mlp.fc2",
        "mm.model.fc": "mm.linear_1",
    }

    def __init__(self, backend: Backend):
        super().__init__(backend)
        self.w = bind(Llama4VisionWeights, self.weights)  # type: ignore[arg-type]
        self.layers = [bind(ViTLayer, self.weights, f"v.blk.{i}.") for i in range(self.n_layer)]  # type: ignore[arg-type]
        path = backend.model.path if backend.model else ""
        if self.layout == "ollama":  # Ollama's key for the epsilon
            self.eps = self.config.get_float("vision.layer_norm_epsilon", self.eps)
        if self.layout == "mmproj":
            self.merge = self.config.get_uint("vision.projector.scale_factor", 1)
        else:  # Ollama's: the pixel shuffle ratio, 0.5 for every Llama 4
            ratio = self.config.get_float("vision.pixel_shuffle_ratio", 0.5)
            self.merge = round(1.0 / ratio) if ratio > 0 else 0
        self.side = self.image_size // self.patch_size
        if not self.merge or self.side % self.merge or (self.n_embd // self.n_head) % 4:
            raise ModelError(f"{path}: {self.side} patches a side do not shuffle by {self.merge}, or a head of "
                             f"{self.n_embd // self.n_head} does not split into two rotary halves")
        patches = self.side * self.side
        checks = [(self.w.patch_embd.shape[:2], (3 * self.patch_size**2, self.n_embd), "patch embedding"),
                  (self.w.position_embd.shape[:2], (self.n_embd, patches + 1), "position embeddings"),
                  (self.w.class_embd.shape[:1], (self.n_embd,), "class embedding"),
                  (self.w.mlp_1.shape[:1], (self.n_embd * self.merge**2,), "adapter")]
        for got, want, what in checks:
            if tuple(got) != want:
                raise ModelError(f"{path}: {what} {tuple(got)}, expected {want}")
        rows = np.arange(patches, dtype=np.int32) // self.side + 1  # the class token, last, keeps 0
        columns = np.arange(patches, dtype=np.int32) % self.side + 1
        self.pos_h = np.append(rows, np.int32(0))
        self.pos_w = np.append(columns, np.int32(0))
        self.options = ViTOptions(self.n_embd, self.n_head, self.eps, backend.flash_attention)

    @property
    def text_embd(self) -> int:
        return self.w.projection.ne[1]

    def tokens(self, image: DecodedImage) -> int:
        per_tile = (self.side // self.merge) ** 2
        return per_tile * tile_count(image.width, image.height, self.image_size)

    def pixels(self, image: DecodedImage) -> np.ndarray:
        """The thumbnail's planes (the tiles come from encode_chunks)."""
        return to_planar(tiles(image.pixels, self.image_size)[-1], self.pixel_spec)

    def encode_chunks(self, image: DecodedImage) -> list[np.ndarray]:
        """One chunk per tile, row by row, then the thumbnail's: mtmd's chunks for the image."""
        out = []
        for tile in tiles(image.pixels, self.image_size):
            planes = to_planar(tile, self.pixel_spec)
            ctx, inp, result = self._graph_for(planes.shape)
            ctx.set_input(inp, planes)
            embeddings = ctx.compute(result, read=result)
            assert embeddings is not None
            out.append(embeddings)
        return out

    def encode(self, image: DecodedImage) -> np.ndarray:
        return np.concatenate(self.encode_chunks(image))

    def build(self, ctx: Context, pixels: Tensor) -> Tensor:
        p, n_embd, patches = self.patch_size, self.n_embd, self.side * self.side
        # Llama4UnfoldConvolution: the patches unfolded (im2col, F32) and projected by one linear
        kernel = self.w.patch_embd.in_graph(ctx).reshape(p, p, 3, n_embd)
        x = self.w.patch_embd.matmul(kernel.im2col(pixels, p, DType.F32)).reshape(n_embd, patches)
        x = x.concat(self.w.class_embd.in_graph(ctx).reshape(n_embd, 1), 1)  # the class token goes last
        x = x.add(self.w.position_embd)
        x = x.layer_norm(self.w.pre_ln, self.w.pre_ln_b, self.eps)
        inputs = ctx.input()
        pos_h = inputs.from_numpy(self.pos_h).set_name("pos_h")
        pos_w = inputs.from_numpy(self.pos_w).set_name("pos_w")
        for i, layer in enumerate(self.layers):  # first half of a head: x (columns), second: y (rows)
            x = vit_block(layer, x, self.options, lambda t: rope_2d(t, pos_w, pos_h, ROPE_THETA, False))
            x = x.set_name(f"layer_out-{i}")
        x = x.layer_norm(self.w.post_ln, self.w.post_ln_b, self.eps)
        x = x.view(0, (n_embd, patches), (x.strides[1],))  # the class token dropped
        x = self.pixel_shuffle(x)
        x = self.w.mlp_2.matmul(self.w.mlp_1.matmul(x).gelu()).gelu()
        return self.w.projection.matmul(x).set_name("mm_out")

    def pixel_shuffle(self, x: Tensor) -> Tensor:
        """(n_embd, patches) -> (n_embd * merge², patches / merge²): each merge x merge square of patches into
        one row, in Llama4VisionPixelShuffleMLP's (and llama.cpp's) order."""
        m, n_embd, side = self.merge, self.n_embd, self.side
        x = x.reshape(n_embd * m, side // m, side, 1).permute(0, 2, 1, 3)
        x = x.contiguous(n_embd * m * m, side // m, side // m, 1)
        return x.contiguous(n_embd * m * m, (side // m) ** 2)

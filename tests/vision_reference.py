"""llama.cpp's mtmd (libmtmd in llama-cpp-python 0.3.36) on a text GGUF and an mmproj GGUF: image
embeddings as mtmd_encode_chunk computes them, and prompts with images as mtmd_helper_eval_chunks
decodes them, to compare our towers with."""

from __future__ import annotations

import ctypes
from pathlib import Path

import numpy as np

FLASH = {False: 0, True: 1}  # llama_flash_attn_type: disabled, enabled
M_PERTURB = -6  # glibc's mallopt: each block malloc returns is filled with (byte ^ 0xff), each freed one with byte


def zero_new_allocations(on: bool) -> None:
    """From now on every block glibc's malloc returns is zeroed (or no longer). llama.cpp's pixtral graph reads an
    uninitialised tensor (its [IMG_BREAK] rows are ggml_scale(x, 0) + the embedding): in a compute buffer recycled
    from what this test process freed before, a NaN there made break rows NaN (and the logits after them), so the
    reference's answer depended on the tests that ran first. Zeroed, it is llama.cpp's on a fresh process."""
    try:
        ctypes.CDLL(None).mallopt(M_PERTURB, 0xFF if on else 0)
    except (OSError, AttributeError):  # not glibc: nothing to do
        pass


class MtmdReference:
    """A llama.cpp model + context + mtmd context on (text, mmproj) files."""

    def __init__(self, text_path: Path, mmproj_path: Path, *, flash_attention: bool = False, threads: int = 2,
                 n_ctx: int = 1024, n_batch: int = 512, image_max_tokens: int = 0):
        """image_max_tokens: mtmd's cap on a dynamic-resolution image's tokens (0: the projector's own)."""
        import llama_cpp
        from llama_cpp import mtmd_cpp

        self.lib, self.mtmd = llama_cpp, mtmd_cpp
        zero_new_allocations(True)  # until close()
        llama_cpp.llama_backend_init()
        self.model = llama_cpp.llama_model_load_from_file(str(text_path).encode(),
                                                          llama_cpp.llama_model_default_params())
        if not self.model:
            raise RuntimeError(f"llama.cpp could not load {text_path}")
        params = llama_cpp.llama_context_default_params()
        params.n_ctx, params.n_batch, params.n_ubatch = n_ctx, n_batch, n_batch
        params.n_threads = params.n_threads_batch = threads
        params.flash_attn_type = FLASH[flash_attention]
        params.swa_full = False
        self.ctx = llama_cpp.llama_init_from_model(self.model, params)
        vparams = mtmd_cpp.mtmd_context_params_default()
        vparams.use_gpu = False
        vparams.print_timings = False
        vparams.n_threads = threads
        vparams.flash_attn_type = FLASH[flash_attention]
        vparams.warmup = False
        vparams.image_max_tokens = image_max_tokens
        self.vctx = mtmd_cpp.mtmd_init_from_file(str(mmproj_path).encode(), self.model, vparams)
        if not self.vctx:
            raise RuntimeError(f"mtmd could not load {mmproj_path}")
        self.n_embd = llama_cpp.llama_model_n_embd(self.model)
        self.vocab_size = llama_cpp.llama_vocab_n_tokens(llama_cpp.llama_model_get_vocab(self.model))
        self.n_batch = n_batch

    # ------------------------------------------------------------ images

    def bitmap(self, rgb: np.ndarray):
        """An mtmd bitmap of (height, width, 3) uint8 pixels."""
        rgb = np.ascontiguousarray(rgb, dtype=np.uint8)
        data = rgb.ctypes.data_as(ctypes.POINTER(ctypes.c_uint8))
        return self.mtmd.mtmd_bitmap_init(rgb.shape[1], rgb.shape[0], data)

    def stb_decode(self, encoded: bytes) -> np.ndarray:
        """The pixels stb_image decodes from an image file's bytes (what llama-server feeds mtmd)."""
        buf = (ctypes.c_uint8 * len(encoded)).from_buffer_copy(encoded)
        bitmap = self.mtmd.mtmd_helper_bitmap_init_from_buf(self.vctx, buf, len(encoded), False)
        if not bitmap:
            raise ValueError("stb_image could not decode the data")
        try:
            nx, ny = self.mtmd.mtmd_bitmap_get_nx(bitmap), self.mtmd.mtmd_bitmap_get_ny(bitmap)
            pointer = self.mtmd.mtmd_bitmap_get_data(bitmap)
            return np.ctypeslib.as_array(ctypes.cast(pointer, ctypes.POINTER(ctypes.c_uint8)),
                                         shape=(ny, nx, 3)).copy()
        finally:
            self.mtmd.mtmd_bitmap_free(bitmap)

    def _chunks(self, text: str, images: list[np.ndarray]):
        bitmaps = [self.bitmap(rgb) for rgb in images]
        chunks = self.mtmd.mtmd_input_chunks_init()
        encoded = text.encode()
        inp = self.mtmd.mtmd_input_text(encoded, len(encoded), True, True)
        array = (self.mtmd.mtmd_bitmap_p_ctypes * max(1, len(bitmaps)))(*bitmaps)
        try:
            if self.mtmd.mtmd_tokenize(self.vctx, chunks, ctypes.byref(inp), array, len(bitmaps)) != 0:
                raise RuntimeError("mtmd_tokenize failed")
        finally:
            for bitmap in bitmaps:
                self.mtmd.mtmd_bitmap_free(bitmap)
        return chunks

    def encode(self, rgb: np.ndarray) -> np.ndarray:
        """(tokens, n_embd) embeddings of one image (mtmd_encode_chunk)."""
        chunks = self._chunks(self.mtmd.mtmd_default_marker().decode(), [rgb])
        try:
            for i in range(self.mtmd.mtmd_input_chunks_size(chunks)):
                chunk = self.mtmd.mtmd_input_chunks_get(chunks, i)
                if self.mtmd.mtmd_input_chunk_get_type(chunk) == self.mtmd.MTMD_INPUT_CHUNK_TYPE_IMAGE:
                    if self.mtmd.mtmd_encode_chunk(self.vctx, chunk) != 0:
                        raise RuntimeError("mtmd_encode_chunk failed")
                    n = self.mtmd.mtmd_input_chunk_get_n_tokens(chunk)
                    out = self.mtmd.mtmd_get_output_embd(self.vctx)
                    return np.ctypeslib.as_array(ctypes.cast(out, ctypes.POINTER(ctypes.c_float)),
                                                 shape=(n, self.n_embd)).copy()
        finally:
            self.mtmd.mtmd_input_chunks_free(chunks)
        raise RuntimeError("no image chunk")

    # ------------------------------------------------------------ prompts with images

    def eval_prompt(self, text: str, images: list[np.ndarray]) -> tuple[np.ndarray, int, list[tuple[str, object]]]:
        """Decode a prompt (images at mtmd's marker) with mtmd_helper_eval_chunks from an empty cache:
        the last position's logits, the next position, and the chunks as ("text", tokens) / ("image", n)."""
        self.lib.llama_memory_clear(self.lib.llama_get_memory(self.ctx), True)
        chunks = self._chunks(text, images)
        try:
            layout: list[tuple[str, object]] = []
            for i in range(self.mtmd.mtmd_input_chunks_size(chunks)):
                chunk = self.mtmd.mtmd_input_chunks_get(chunks, i)
                if self.mtmd.mtmd_input_chunk_get_type(chunk) == self.mtmd.MTMD_INPUT_CHUNK_TYPE_TEXT:
                    n = ctypes.c_size_t()
                    tokens = self.mtmd.mtmd_input_chunk_get_tokens_text(chunk, ctypes.byref(n))
                    layout.append(("text", [tokens[j] for j in range(n.value)]))
                else:
                    layout.append(("image", self.mtmd.mtmd_input_chunk_get_n_tokens(chunk)))
            new_past = self.lib.llama_pos(0)
            if self.mtmd.mtmd_helper_eval_chunks(self.vctx, self.ctx, chunks, 0, 0, self.n_batch, True,
                                                 ctypes.byref(new_past)) != 0:
                raise RuntimeError("mtmd_helper_eval_chunks failed")
        finally:
            self.mtmd.mtmd_input_chunks_free(chunks)
        return self.logits(-1), new_past.value, layout

    def logits(self, index: int) -> np.ndarray:
        pointer = self.lib.llama_get_logits_ith(self.ctx, index)
        return np.ctypeslib.as_array(ctypes.cast(pointer, ctypes.POINTER(ctypes.c_float)),
                                     shape=(self.vocab_size,)).copy()

    def decode_token(self, token: int, position: int) -> np.ndarray:
        """One more token after the prompt: its logits."""
        batch = self.lib.llama_batch_init(1, 0, 1)
        try:
            batch.n_tokens = 1
            batch.token[0], batch.pos[0], batch.n_seq_id[0], batch.logits[0] = token, position, 1, True
            batch.seq_id[0][0] = 0
            if self.lib.llama_decode(self.ctx, batch) != 0:
                raise RuntimeError("llama_decode failed")
        finally:
            self.lib.llama_batch_free(batch)
        return self.logits(0)

    def close(self) -> None:
        self.mtmd.mtmd_free(self.vctx)
        self.lib.llama_free(self.ctx)
        self.lib.llama_model_free(self.model)
        zero_new_allocations(False)

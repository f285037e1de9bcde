"""llama.cpp as a peer engine: a model converted by `litevlm convert --to gguf` answering through llama-cpp-python's
bindings of llama.cpp and of its multimodal library mtmd, greedy, stage by stage.

Two ways in, both greedy to the first end-of-generation token:

- `answer_files`, llama.cpp's own way (as its mtmd CLI and server run): the image files decoded by mtmd's helper, each
  image tiled and normalised by mtmd and written where the prompt text has a media marker (`MARKER`), the text
  tokenized by llama.cpp. Its tiling differs from litevlm's (`litevlm.model.gguf`: a thumbnail after the tiles).
- `answer_tiles`: litevlm's own prompt ids and tiles, each tile handed to mtmd as an S x S bitmap (which it neither
  resizes nor tiles, only normalises) and encoded by mtmd's vision tower and projector, its embeddings decoded at
  litevlm's image placeholders: the same visual tokens and prompt as litevlm's baseline, for exact comparisons.

Stages, wall milliseconds (llama.cpp runs on the CPU, synchronously): `load` (image files to bitmaps), `tokenize`
(the prompt into chunks, mtmd's image preprocessing included), `encode` (mtmd's vision tower and projector),
`prompt` (text tokens and image embeddings through the decoder), `generate` (the greedy loop), and `e2e`, all of it.
llama.cpp's own counters (`llama_perf_context`) are kept beside them.
"""

from __future__ import annotations

import ctypes
import os
import time
from dataclasses import dataclass, field

import numpy as np

from litevlm.errors import LiteVLMError

MARKER = "<__media__>"  # mtmd's default media marker: where an image goes in the prompt text
_SILENT = []  # the no-op log callback handed to llama.cpp and mtmd, kept alive as long as the process


def _bindings():
    try:
        import llama_cpp
        from llama_cpp import mtmd_cpp
    except ImportError:
        raise LiteVLMError("running llama.cpp needs llama-cpp-python: pip install 'litevlm[llamacpp]'") from None
    return llama_cpp, mtmd_cpp


def _quiet(llama_cpp, mtmd_cpp) -> None:
    if not _SILENT:
        _SILENT.append(llama_cpp.llama_log_callback(lambda level, text, user: None))
    llama_cpp.llama_log_set(_SILENT[0], None)
    mtmd_cpp.mtmd_log_set(_SILENT[0], None)
    mtmd_cpp.mtmd_helper_log_set(_SILENT[0], None)


@dataclass
class PeerAnswer:
    """One greedy answer: the token ids made (the end-of-generation token included where it stopped), each stage's
    milliseconds, the prompt's length in positions and how many of them are visual tokens, and llama.cpp's counters."""

    tokens: list[int]
    ms: dict[str, float]
    input_tokens: int
    visual_tokens: int
    perf: dict[str, float] = field(default_factory=dict)


class LlamaCpp:
    """A converted model (`litevlm.model.gguf.GGUFFiles`) loaded in llama.cpp on `threads` threads (None: the
    machine's cores), decoder and mmproj on the CPU; one prompt at a time, the cache cleared before each. The KV cache
    is llama.cpp's default f16 unless `f32_cache`."""

    def __init__(
        self,
        files,
        threads: int | None = None,
        n_ctx: int = 4096,
        n_batch: int = 512,
        f32_cache: bool = False,
        quiet: bool = True,
    ):
        llama_cpp, mtmd_cpp = _bindings()
        self.lc, self.mt = llama_cpp, mtmd_cpp
        if quiet:
            _quiet(llama_cpp, mtmd_cpp)
        self.threads = threads or os.cpu_count() or 1
        self.llm = llama_cpp.Llama(
            str(files.text),
            n_ctx=n_ctx,
            n_batch=n_batch,
            n_ubatch=n_batch,
            n_threads=self.threads,
            n_threads_batch=self.threads,
            n_gpu_layers=0,
            type_k=0 if f32_cache else None,  # GGML_TYPE_F32; llama.cpp's default cache is f16
            type_v=0 if f32_cache else None,
            verbose=not quiet,
        )
        params = mtmd_cpp.mtmd_context_params_default()
        params.use_gpu, params.print_timings, params.n_threads = False, not quiet, self.threads
        self.mtmd = mtmd_cpp.mtmd_init_from_file(str(files.mmproj).encode(), self.llm.model, params)
        if not self.mtmd:
            raise LiteVLMError(f"llama.cpp's mtmd could not load {files.mmproj}")
        self.ctx, self.n_batch = self.llm.ctx, n_batch
        self.vocab = llama_cpp.llama_model_get_vocab(self.llm.model)
        self.n_vocab = llama_cpp.llama_vocab_n_tokens(self.vocab)
        self.n_embd = llama_cpp.llama_model_n_embd(self.llm.model)
        self._tokens = llama_cpp.llama_batch_init(n_batch, 0, 1)
        self._embd = llama_cpp.llama_batch_init(n_batch, self.n_embd, 1)

    def close(self) -> None:
        if self.mtmd:
            self.lc.llama_batch_free(self._tokens)
            self.lc.llama_batch_free(self._embd)
            self.mt.mtmd_free(self.mtmd)
            self.mtmd = None
            self.llm.close()

    def __enter__(self) -> LlamaCpp:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -- the decoder ----------------------------------------------------------------------------
    def tokenize(self, text: str) -> list[int]:
        """llama.cpp's ids of `text`, special-token strings parsed, nothing added."""
        return self.llm.tokenize(text.encode(), add_bos=False, special=True)

    def reset(self) -> None:
        self.lc.llama_memory_clear(self.lc.llama_get_memory(self.ctx), True)
        self.lc.llama_perf_context_reset(self.ctx)

    def _logits(self, i: int) -> np.ndarray:
        ptr = self.lc.llama_get_logits_ith(self.ctx, i)
        return np.ctypeslib.as_array(ptr, shape=(self.n_vocab,)).copy()

    def _run(self, batch, n: int, pos: int, all_logits: bool) -> None:
        batch.n_tokens = n
        for i in range(n):
            batch.pos[i], batch.n_seq_id[i], batch.logits[i] = pos + i, 1, all_logits or i == n - 1
            batch.seq_id[i][0] = 0
        if self.lc.llama_decode(self.ctx, batch) != 0:
            raise LiteVLMError("llama.cpp failed to decode a batch (is the prompt longer than the context?)")

    def decode_tokens(self, ids: list[int], pos: int, all_logits: bool = False) -> np.ndarray:
        """`ids` into the cache from position `pos` -> the logits of the last (all_logits: of every) token."""
        out = []
        for s in range(0, len(ids), self.n_batch):
            part = ids[s : s + self.n_batch]
            for i, t in enumerate(part):
                self._tokens.token[i] = t
            self._run(self._tokens, len(part), pos + s, all_logits)
            if all_logits:
                out += [self._logits(i) for i in range(len(part))]
        return np.stack(out) if all_logits else self._logits(len(ids) - 1 - s)

    def decode_embeddings(self, embd: np.ndarray, pos: int) -> np.ndarray:
        """(n, C) embeddings into the cache from position `pos` -> the last one's logits."""
        embd = np.ascontiguousarray(embd, dtype=np.float32)
        for s in range(0, len(embd), self.n_batch):
            part = embd[s : s + self.n_batch]
            ctypes.memmove(self._embd.embd, part.ctypes.data, part.nbytes)
            self._run(self._embd, len(part), pos + s, False)
        return self._logits(len(part) - 1)

    def logits(self, ids: list[int]) -> np.ndarray:
        """(T, V) logits of a text prompt, from an empty cache."""
        self.reset()
        return self.decode_tokens(ids, 0, all_logits=True)

    def greedy(self, logits: np.ndarray, pos: int, max_new_tokens: int) -> list[int]:
        """Greedy tokens from the prompt's last logits, the prompt `pos` positions long, to an end-of-generation token
        (kept) or `max_new_tokens`."""
        out = [int(np.argmax(logits))]
        while not self.lc.llama_vocab_is_eog(self.vocab, out[-1]) and len(out) < max_new_tokens:
            out.append(int(np.argmax(self.decode_tokens([out[-1]], pos))))
            pos += 1
        return out

    def perf(self) -> dict[str, float]:
        """llama.cpp's own counters since the last reset: prompt and generation milliseconds and token counts."""
        p = self.lc.llama_perf_context(self.ctx)
        return {
            "prompt_eval_ms": round(p.t_p_eval_ms, 3),
            "prompt_eval_tokens": p.n_p_eval,
            "eval_ms": round(p.t_eval_ms, 3),
            "eval_tokens": p.n_eval,
        }

    # -- images ---------------------------------------------------------------------------------
    def _tokenize_media(self, text: str, bitmaps: list) -> object:
        chunks = self.mt.mtmd_input_chunks_init()
        raw = text.encode()
        inp = self.mt.mtmd_input_text(raw, len(raw), False, True)  # text, length, add_special, parse_special
        array = (self.mt.mtmd_bitmap_p_ctypes * len(bitmaps))(*bitmaps)
        if self.mt.mtmd_tokenize(self.mtmd, chunks, ctypes.byref(inp), array, len(bitmaps)) != 0:
            self.mt.mtmd_input_chunks_free(chunks)
            raise LiteVLMError(f"mtmd could not tokenize the prompt with {len(bitmaps)} images")
        return chunks

    def _chunks(self, chunks):
        for i in range(self.mt.mtmd_input_chunks_size(chunks)):
            yield self.mt.mtmd_input_chunks_get(chunks, i)

    def _encode(self, chunk) -> np.ndarray:
        """An image chunk through mtmd's vision tower and projector -> its (tokens, C) embeddings."""
        if self.mt.mtmd_encode_chunk(self.mtmd, chunk) != 0:
            raise LiteVLMError("mtmd failed to encode an image")
        n = self.mt.mtmd_input_chunk_get_n_tokens(chunk)
        return np.ctypeslib.as_array(self.mt.mtmd_get_output_embd(self.mtmd), shape=(n, self.n_embd)).copy()

    def _text_ids(self, chunk) -> list[int]:
        n = ctypes.c_size_t()
        ptr = self.mt.mtmd_input_chunk_get_tokens_text(chunk, ctypes.byref(n))
        return [ptr[i] for i in range(n.value)]

    def _bitmap(self, tile: np.ndarray):
        """A (3, S, S) uint8 tile as an mtmd bitmap (RGB, row-major)."""
        hwc = np.ascontiguousarray(tile.transpose(1, 2, 0))
        data = hwc.ctypes.data_as(ctypes.POINTER(ctypes.c_uint8))
        return self.mt.mtmd_bitmap_init(hwc.shape[1], hwc.shape[0], data)

    def encode_tiles(self, tiles: np.ndarray) -> np.ndarray:
        """(N, 3, S, S) uint8 tiles, each encoded alone by mtmd -> (N, tokens per tile, C) embeddings."""
        out = []
        for tile in tiles:
            bitmap = self._bitmap(tile)
            chunks = self._tokenize_media(MARKER, [bitmap])
            try:
                out += [self._encode(c) for c in self._chunks(chunks) if self._is_image(c)]
            finally:
                self.mt.mtmd_input_chunks_free(chunks)
                self.mt.mtmd_bitmap_free(bitmap)
        return np.stack(out)

    def _is_image(self, chunk) -> bool:
        return self.mt.mtmd_input_chunk_get_type(chunk) == self.mt.MTMD_INPUT_CHUNK_TYPE_IMAGE

    # -- answers --------------------------------------------------------------------------------
    def answer_files(self, text: str, paths: list, max_new_tokens: int) -> PeerAnswer:
        """The prompt `text` with one `MARKER` per image file of `paths`, answered the way llama.cpp's own tools do."""
        ms: dict[str, float] = {}
        t0 = time.perf_counter()
        self.reset()
        bitmaps = [self.mt.mtmd_helper_bitmap_init_from_file(self.mtmd, str(p).encode(), False) for p in paths]
        if not all(bitmaps):
            for b in bitmaps:
                if b:
                    self.mt.mtmd_bitmap_free(b)
            raise LiteVLMError(f"llama.cpp could not read the images {', '.join(str(p) for p in paths)}")
        t1 = time.perf_counter()
        chunks = self._tokenize_media(text, bitmaps)
        t2 = time.perf_counter()
        ms = {"load": (t1 - t0) * 1e3, "tokenize": (t2 - t1) * 1e3, "encode": 0.0, "prompt": 0.0}
        try:
            pos, visual, logits = 0, 0, None
            for chunk in self._chunks(chunks):
                t = time.perf_counter()
                if self._is_image(chunk):
                    embd = self._encode(chunk)
                    ms["encode"] += (time.perf_counter() - t) * 1e3
                    t = time.perf_counter()
                    logits = self.decode_embeddings(embd, pos)
                    pos, visual = pos + len(embd), visual + len(embd)
                else:
                    ids = self._text_ids(chunk)
                    logits = self.decode_tokens(ids, pos)
                    pos += len(ids)
                ms["prompt"] += (time.perf_counter() - t) * 1e3
        finally:
            self.mt.mtmd_input_chunks_free(chunks)
            for b in bitmaps:
                self.mt.mtmd_bitmap_free(b)
        return self._finish(logits, pos, visual, max_new_tokens, ms, t0)

    def answer_tiles(
        self, ids: list[int], spans: list[tuple[int, int]], tiles: np.ndarray, max_new_tokens: int
    ) -> PeerAnswer:
        """litevlm's prompt `ids` whose image placeholders `spans` ((start, end) per view, in order) take the
        embeddings mtmd makes of `tiles` ((N, 3, S, S) uint8, tile-major), answered greedily."""
        t0 = time.perf_counter()
        self.reset()
        visual = self.encode_tiles(tiles).reshape(-1, self.n_embd)  # (N * tokens per tile, C)
        t1 = time.perf_counter()
        if sum(e - s for s, e in spans) != len(visual):
            raise LiteVLMError(f"the prompt has {sum(e - s for s, e in spans)} image placeholders for {len(visual)}")
        pos, used = 0, 0
        for s, e in spans:  # text up to the view, then its visual tokens
            if s > pos:
                self.decode_tokens(ids[pos:s], pos)
            self.decode_embeddings(visual[used : used + e - s], s)
            pos, used = e, used + e - s
        logits = self.decode_tokens(ids[pos:], pos)
        ms = {"load": 0.0, "tokenize": 0.0, "encode": (t1 - t0) * 1e3, "prompt": (time.perf_counter() - t1) * 1e3}
        return self._finish(logits, len(ids), len(visual), max_new_tokens, ms, t0)

    def _finish(self, logits, pos: int, visual: int, max_new_tokens: int, ms: dict, t0: float) -> PeerAnswer:
        t = time.perf_counter()
        tokens = self.greedy(logits, pos, max_new_tokens)
        ms["generate"] = (time.perf_counter() - t) * 1e3
        ms["e2e"] = (time.perf_counter() - t0) * 1e3
        return PeerAnswer(tokens, {k: round(v, 3) for k, v in ms.items()}, pos, visual, self.perf())


class LlamaChat:
    """llama-cpp-python's own high-level path for image questions: `Llama.create_chat_completion` with its mtmd chat
    handler (the GGUF's chat template renders the prompt; mtmd reads and tiles the files as in `answer_files`), greedy.
    With `lookup` > 0, its speculative decoding: `LlamaPromptLookupDecoding` drafts up to `lookup` tokens a step from
    n-grams of the prompt and the answer so far, verified by the model (greedy output unchanged). The only
    speculative decoding llama-cpp-python offers an image prompt: its `draft_model` runs inside the same generation
    loop the chat handler's completion uses."""

    def __init__(self, files, threads: int | None = None, lookup: int = 0, n_ctx: int = 4096, quiet: bool = True):
        llama_cpp, _ = _bindings()
        from llama_cpp.llama_chat_format import MTMDChatHandler
        from llama_cpp.llama_speculative import LlamaPromptLookupDecoding

        self.threads = threads or os.cpu_count() or 1
        self.handler = MTMDChatHandler(str(files.mmproj), verbose=not quiet, use_gpu=False)
        draft = LlamaPromptLookupDecoding(num_pred_tokens=lookup) if lookup > 0 else None
        self.llm = llama_cpp.Llama(
            str(files.text),
            chat_handler=self.handler,
            draft_model=draft,
            logits_all=draft is not None,  # its scores buffer holds every position only when asked: a draft needs it
            n_ctx=n_ctx,
            n_threads=self.threads,
            n_threads_batch=self.threads,
            n_gpu_layers=0,
            verbose=not quiet,
        )

    def close(self) -> None:
        self.llm.close()

    def __enter__(self) -> LlamaChat:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def answer(self, labels_and_paths: list[tuple[str, object]], question: str, max_new_tokens: int):
        """The question about the images (each after its text label, e.g. "CAM_FRONT: ") -> (the answer's text, the
        wall ms from the files to the last token, the answer's tokens and the prompt's, by llama.cpp's count)."""
        from pathlib import Path

        content: list[dict] = []
        for label, path in labels_and_paths:
            image = {"type": "image_url", "image_url": {"url": Path(path).resolve().as_uri()}}
            content += [{"type": "text", "text": label}, image, {"type": "text", "text": "\n"}]
        content.append({"type": "text", "text": question})
        t0 = time.perf_counter()
        self.llm.reset()
        out = self.llm.create_chat_completion(
            [{"role": "user", "content": content}], temperature=0.0, max_tokens=max_new_tokens
        )
        ms = (time.perf_counter() - t0) * 1e3
        usage = out["usage"]
        return out["choices"][0]["message"]["content"].strip(), ms, usage["completion_tokens"], usage["prompt_tokens"]


def available() -> bool:
    """Whether llama-cpp-python (the `llamacpp` extra) and the `gguf` writer are installed here."""
    import importlib.util

    return all(importlib.util.find_spec(m) is not None for m in ("llama_cpp", "gguf"))


def answer_on_tiles(lc: LlamaCpp, pipe, question: str, images, max_new_tokens: int) -> tuple[str, PeerAnswer]:
    """llama.cpp answering `question` about `images` (camera -> a file, an array or a PIL image) exactly as `pipe`'s
    baseline prompt puts it: every view read and cut by litevlm (timed, in its e2e), its prompt ids, the tiles encoded
    by mtmd and the embeddings decoded at litevlm's image placeholders -> (the answer's text, the PeerAnswer)."""
    from litevlm.cameras import CAMERAS
    from litevlm.model.vlm import cut_images

    tok, cams = pipe.tokenizer, list(CAMERAS)
    t0 = time.perf_counter()
    cut = cut_images([images[c] for c in cams], pipe.format.tiling, pipe.cfg.vision.image_size)
    layout = pipe.format.build(tok, question, cams, [len(t) * pipe.cfg.tokens_per_tile for t in cut])
    pre = (time.perf_counter() - t0) * 1e3
    a = lc.answer_tiles(layout.ids, [(s, e) for _, s, e in layout.view_spans], np.concatenate(cut), max_new_tokens)
    a.ms["e2e"] += pre
    a.ms["preprocess"] = pre
    return tok.decode([t for t in a.tokens if t != tok.eos_id]).strip(), a

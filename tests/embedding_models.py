"""Tiny random-weight embedding and rerank GGUF models, with real tokenizers.

    write_bert(path, pooling="mean", classifier=False, seed=0, dtype="f32")
    write_qwen3_embedding(path, pooling="last", seed=0, dtype="f32")

`write_bert` writes architecture "bert" with the tensors and metadata keys llama.cpp's
convert_hf_to_gguf.py writes for a BERT model (all-MiniLM-L6-v2's converted file is the
pattern): learned positions, two token-type rows, post-norm layers with biases, GELU feed
forward; the tokenizer is llama.cpp's bert-bge WordPiece vocabulary. `classifier=True` adds a
cross-encoder head, `cls` [D, D] (+ bias, then tanh) and `cls.output` [1, D] (+ bias), read by
rank pooling.

`write_qwen3_embedding` writes architecture "qwen3" (the layers of tests/tiny_models.py, tied
output: no output.weight, as Qwen3-Embedding and Qwen3-Reranker) with `qwen3.pooling_type`.
Pooling other than "rank" makes it a Qwen3-Embedding as converted: tokenizer.ggml.add_eos_token
true, so every text ends in <|endoftext|>, the token last pooling reads. Pooling "rank" makes
it a Qwen3-Reranker as llama.cpp's converter writes one: `cls.output` [2, D] (the lm_head rows
of "yes" and "no"), `qwen3.classifier.output_labels` ["yes", "no"] and the named chat template
`tokenizer.chat_template.rerank` with {query} and {document}; no tokens are added to it.

dtype: "f32", "f16" or "q8_0" for the 2-D projection matrices (token_embd is F16 unless "f32";
positions, token types, norms and biases stay F32). Every builder is deterministic: the same
arguments give a byte-identical file. The weights are random (seeded), scaled so that
activations stay moderate and pooled vectors and rerank scores differ between inputs.
"""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np

from tests.tiny_models import LAYER_TENSORS, add_decoder_shape, copy_tokenizer

POOLING = {"none": gguf.PoolingType.NONE, "mean": gguf.PoolingType.MEAN,
           "cls": gguf.PoolingType.CLS, "last": gguf.PoolingType.LAST,
           "rank": gguf.PoolingType.RANK}
FILE_TYPE = {"f32": gguf.LlamaFileType.ALL_F32, "f16": gguf.LlamaFileType.MOSTLY_F16,
             "q8_0": gguf.LlamaFileType.MOSTLY_Q8_0}
QTYPE = {"f32": gguf.GGMLQuantizationType.F32, "f16": gguf.GGMLQuantizationType.F16,
         "q8_0": gguf.GGMLQuantizationType.Q8_0}

# Qwen3-Reranker's rerank prompt, as llama.cpp's convert_hf_to_gguf.py writes it
QWEN3_RERANK_TEMPLATE = (
    "<|im_start|>system\nJudge whether the Document meets the requirements based on the Query "
    "and the Instruct provided. Note that the answer can only be \"yes\" or \"no\".<|im_end|>\n"
    "<|im_start|>user\n<Instruct>: Given a web search query, retrieve relevant passages that "
    "answer the query\n<Query>: {query}\n<Document>: {document}<|im_end|>\n"
    "<|im_start|>assistant\n<think>\n\n</think>\n\n")


class _Tensors:
    """Seeded random tensors added to a writer in a fixed order."""

    def __init__(self, writer: gguf.GGUFWriter, seed: int, dtype: str):
        if dtype not in QTYPE:
            raise ValueError(f"dtype {dtype!r}: one of {sorted(QTYPE)}")
        self.w, self.rng, self.dtype = writer, np.random.default_rng(seed), dtype

    def add(self, name: str, *shape: int, scale: float, center: float = 0.0,
            dtype: str = "f32") -> None:
        data = (center + scale * self.rng.standard_normal(shape)).astype(np.float32)
        qtype = QTYPE[dtype]
        if qtype == gguf.GGMLQuantizationType.F32:
            self.w.add_tensor(name, data)
        elif qtype == gguf.GGMLQuantizationType.F16:
            self.w.add_tensor(name, data.astype(np.float16))
        else:
            q = gguf.quants.quantize(data, qtype)
            self.w.add_tensor(name, q, raw_shape=q.shape, raw_dtype=qtype)

    def matrix(self, name: str, rows: int, cols: int, scale: float) -> None:
        """A 2-D projection [rows (out), cols (in)] in the model's dtype."""
        self.add(name, rows, cols, scale=scale, dtype=self.dtype)

    def embedding(self, name: str, rows: int, cols: int, scale: float) -> None:
        self.add(name, rows, cols, scale=scale, dtype="f32" if self.dtype == "f32" else "f16")


def _finish(w: gguf.GGUFWriter, path: Path) -> Path:
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return Path(path)


def write_bert(path: Path, *, pooling: str = "mean", classifier: bool = False, seed: int = 0,
               dtype: str = "f32", n_layer: int = 2, d_model: int = 64, n_head: int = 4,
               d_ffn: int = 128, context_length: int = 512) -> Path:
    """A random-weight BERT encoder (bert-bge vocabulary) with `pooling` (none, mean, cls or
    rank) as its default; `classifier` adds the cross-encoder head cls / cls.output (one
    output), which llama.cpp reads under rank pooling. Returns path."""
    if pooling not in ("none", "mean", "cls", "rank"):
        raise ValueError(f"pooling {pooling!r}: none, mean, cls or rank")
    w = gguf.GGUFWriter(str(path), "bert")
    w.add_type(gguf.GGUFType.MODEL)
    w.add_name(f"tiny bert {pooling}" + (" classifier" if classifier else ""))
    w.add_block_count(n_layer)
    w.add_context_length(context_length)
    w.add_embedding_length(d_model)
    w.add_feed_forward_length(d_ffn)
    w.add_head_count(n_head)
    w.add_layer_norm_eps(1e-12)
    w.add_file_type(FILE_TYPE[dtype])
    w.add_causal_attention(False)
    w.add_pooling_type(POOLING[pooling])
    if classifier:
        w.add_classifier_output_labels(["LABEL_0"])
    # the tokenizer keys of a converted BERT (all-MiniLM-L6-v2): [CLS] text [SEP]
    vocab = copy_tokenizer(w, "bert-bge", skip=("tokenizer.ggml.cls_token_id",))
    w.add_bos_token_id(101)
    w.add_eos_token_id(102)
    w.add_add_bos_token(True)
    w.add_add_eos_token(True)
    w.add_add_sep_token(False)

    t = _Tensors(w, seed, dtype)
    d = d_model
    t.embedding("token_embd.weight", vocab, d, scale=0.5)
    t.add("token_types.weight", 2, d, scale=0.5)
    t.add("position_embd.weight", context_length, d, scale=0.5)
    t.add("token_embd_norm.weight", d, scale=0.1, center=1.0)
    t.add("token_embd_norm.bias", d, scale=0.1)
    for i in range(n_layer):
        b = f"blk.{i}."
        for name in ("attn_q", "attn_k", "attn_v"):
            t.matrix(b + name + ".weight", d, d, scale=0.25)
            t.add(b + name + ".bias", d, scale=0.1)
        t.matrix(b + "attn_output.weight", d, d, scale=0.12)
        t.add(b + "attn_output.bias", d, scale=0.05)
        t.add(b + "attn_output_norm.weight", d, scale=0.1, center=1.0)
        t.add(b + "attn_output_norm.bias", d, scale=0.1)
        t.matrix(b + "ffn_up.weight", d_ffn, d, scale=0.15)
        t.add(b + "ffn_up.bias", d_ffn, scale=0.1)
        t.matrix(b + "ffn_down.weight", d, d_ffn, scale=0.1)
        t.add(b + "ffn_down.bias", d, scale=0.05)
        t.add(b + "layer_output_norm.weight", d, scale=0.1, center=1.0)
        t.add(b + "layer_output_norm.bias", d, scale=0.1)
    if classifier:
        t.matrix("cls.weight", d, d, scale=0.15)
        t.add("cls.bias", d, scale=0.1)
        t.add("cls.output.weight", 1, d, scale=0.3)
        t.add("cls.output.bias", 1, scale=0.1)
    return _finish(w, path)


def write_qwen3_embedding(path: Path, *, pooling: str = "last", seed: int = 0,
                          dtype: str = "f32", n_layer: int = 2, d_model: int = 64,
                          n_head: int = 4, n_kv_head: int = 2, head_dim: int = 16,
                          d_ffn: int = 128, context_length: int = 512) -> Path:
    """A random-weight Qwen3 (qwen2 vocabulary, tied output) whose default pooling is
    `pooling` (last, mean, cls, none or rank); rank makes it a Qwen3-Reranker (cls.output
    [2, D] for "yes"/"no", the rerank chat template). Returns path."""
    if pooling not in POOLING:
        raise ValueError(f"pooling {pooling!r}: one of {sorted(POOLING)}")
    w = gguf.GGUFWriter(str(path), "qwen3")
    w.add_type(gguf.GGUFType.MODEL)
    w.add_name(f"tiny qwen3 {pooling}")
    add_decoder_shape(w, n_layer=n_layer, context_length=context_length, d_model=d_model,
                      d_ffn=d_ffn, n_head=n_head, n_kv_head=n_kv_head, head_dim=head_dim,
                      rope_base=1000000.0)
    w.add_file_type(FILE_TYPE[dtype])
    w.add_pooling_type(POOLING[pooling])
    vocab = copy_tokenizer(w, "qwen2")
    if pooling != "rank":
        # as a converted Qwen3-Embedding: text <|endoftext|>, pooled at that last token
        w.add_add_eos_token(True)
        w.add_eot_token_id(151645)
    if pooling == "rank":
        w.add_classifier_output_labels(["yes", "no"])
        w.add_chat_template([{"name": "rerank", "template": QWEN3_RERANK_TEMPLATE}])

    t = _Tensors(w, seed, dtype)
    q, kv = n_head * head_dim, n_kv_head * head_dim
    shapes = {"attn_q": (q, d_model), "attn_k": (kv, d_model), "attn_v": (kv, d_model),
              "attn_output": (d_model, q), "ffn_gate": (d_ffn, d_model),
              "ffn_up": (d_ffn, d_model), "ffn_down": (d_model, d_ffn)}
    scales = {"attn_q": 0.15, "attn_k": 0.15, "attn_v": 0.15, "attn_output": 0.1,
              "ffn_gate": 0.15, "ffn_up": 0.15, "ffn_down": 0.1}
    norm_shapes = {"attn_q_norm": head_dim, "attn_k_norm": head_dim}
    t.embedding("token_embd.weight", vocab, d_model, scale=0.5)
    for i in range(n_layer):
        for name in LAYER_TENSORS["qwen3"]:
            full = f"blk.{i}.{name}.weight"
            if name.endswith("norm"):
                t.add(full, norm_shapes.get(name, d_model), scale=0.1, center=1.0)
            else:
                t.matrix(full, *shapes[name], scale=scales[name])
    t.add("output_norm.weight", d_model, scale=0.1, center=1.0)
    if pooling == "rank":
        t.add("cls.output.weight", 2, d_model, scale=0.3)
    return _finish(w, path)

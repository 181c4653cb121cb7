"""llama.cpp's `llama-server` for the real tier: the binary, models made at test time, the process.

No model file lives in the repository and none is downloaded: `write_model` writes a llama-architecture
GGUF with random weights (an SPM vocabulary of the 256 byte tokens plus printable ASCII, a ChatML
template) in well under a second. Random weights rarely pick EOS, so streams run to `max_tokens`, and
greedy decoding (temperature 0) makes every answer the same twice: what the equality tests need.
"""

from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from support.backend import BackendProcess
from support.ports import free_port

REPO = Path(__file__).resolve().parents[2]
BUILD_SCRIPT = REPO / "scripts" / "build-llama-server.sh"

CHATML = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def binary_path() -> Path:
    """Where the build script puts (or has put) the binary for this CPU."""
    out = subprocess.run(["bash", str(BUILD_SCRIPT), "--path"], capture_output=True, text=True, check=True)
    return Path(out.stdout.strip().splitlines()[-1])


def build_binary() -> Path:
    """Build (or find) the binary; the build's progress goes to the terminal."""
    env = {**os.environ, "PYTHON": os.environ.get("PYTHON", sys.executable)}  # this venv has pip
    out = subprocess.run(["bash", str(BUILD_SCRIPT)], stdout=subprocess.PIPE, text=True, check=True, env=env)
    return Path(out.stdout.strip().splitlines()[-1])


@dataclass(frozen=True)
class ModelShape:
    embedding: int
    layers: int
    heads: int
    context: int = 512
    seed: int = 1234
    text_only: bool = False  # it can only say printable ASCII and spaces (see `write_model`)

    @property
    def feed_forward(self) -> int:
        return self.embedding * 8 // 3 // 32 * 32 or 32


TINY = ModelShape(embedding=64, layers=2, heads=4)  # about 400 tokens/s: the equality and fault tests
WIDE = ModelShape(embedding=512, layers=8, heads=8)  # about 15 ms per token: the cancellation tests
CHARS = ModelShape(embedding=64, layers=2, heads=4, seed=4321, text_only=True)  # the resume tests


def _vocabulary() -> tuple[list[bytes], list[float], list[int]]:
    from gguf import TokenType

    tokens: list[bytes] = [b"<unk>", b"<s>", b"</s>", b"<|im_start|>", b"<|im_end|>"]
    types: list[int] = [TokenType.UNKNOWN, TokenType.CONTROL, TokenType.CONTROL, TokenType.CONTROL, TokenType.CONTROL]
    tokens += [f"<0x{byte:02X}>".encode() for byte in range(256)]
    types += [TokenType.BYTE] * 256
    tokens.append("\u2581".encode())  # SPM's word boundary (a space)
    types.append(TokenType.NORMAL)
    for code in range(33, 127):
        tokens.append(chr(code).encode())
        types.append(TokenType.NORMAL)
    scores = [0.0] * 5 + [0.0] * 256 + [-1.0 - i * 0.01 for i in range(len(tokens) - 261)]
    return tokens, scores, [int(t) for t in types]


# A text_only model: the residual stream's dimension 0 holds this constant in every position and
# layer (every matrix that reads the stream ignores it, none writes it), so after the final norm it is
# always positive, and an output column of -BAN there keeps a token from ever being the likeliest.
_CONSTANT, _BAN = 1.0, 200.0


def _text_tokens(types: list[int]) -> np.ndarray:
    """The tokens whose text is one printable character or the space: all a text_only model says."""
    from gguf import TokenType

    return np.array([t == TokenType.NORMAL for t in types], dtype=bool)


def write_model(path: Path, shape: ModelShape) -> Path:
    """A loadable GGUF with random weights (F16 matrices, F32 norms).

    `text_only`: every text token of this vocabulary is one character, and the weights forbid the
    others (bytes, controls, EOS), so any text the model writes tokenizes back into exactly the
    tokens that wrote it: a continuation of its answer from the text alone is token for token the
    answer it would have given (what the --resume-on-cut tests compare), and it runs to max_tokens.
    """
    from gguf import GGUFWriter, LlamaFileType

    tokens, scores, types = _vocabulary()
    vocab, n, ff = len(tokens), shape.embedding, shape.feed_forward
    rng = np.random.default_rng(shape.seed)
    text_only = shape.text_only

    def matrix(rows: int, cols: int, role: str = "") -> np.ndarray:  # numpy order: (ggml ne[1], ggml ne[0])
        m = rng.standard_normal((rows, cols), dtype=np.float32) * 0.05
        if text_only and role == "reads":  # input dimension 0 is ignored
            m[:, 0] = 0.0
        elif text_only and role == "writes":  # output dimension 0 is never written
            m[0, :] = 0.0
        return m.astype(np.float16)

    embeddings = matrix(vocab, n)
    output = matrix(vocab, n)
    if text_only:
        embeddings[:, 0] = _CONSTANT
        output[:, 0] = np.where(_text_tokens(types), 0.0, -_BAN)

    writer = GGUFWriter(str(path), "llama")
    writer.add_name("streamwarden-test")
    writer.add_file_type(LlamaFileType.MOSTLY_F16)
    writer.add_context_length(shape.context)
    writer.add_embedding_length(n)
    writer.add_block_count(shape.layers)
    writer.add_feed_forward_length(ff)
    writer.add_head_count(shape.heads)
    writer.add_head_count_kv(shape.heads)
    writer.add_rope_dimension_count(n // shape.heads)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_vocab_size(vocab)
    writer.add_tokenizer_model("llama")
    writer.add_token_list(tokens)
    writer.add_token_scores(scores)
    writer.add_token_types(types)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_unk_token_id(0)
    writer.add_add_bos_token(True)
    writer.add_chat_template(CHATML)
    writer.add_tensor("token_embd.weight", embeddings)
    writer.add_tensor("output_norm.weight", np.ones(n, dtype=np.float32))
    writer.add_tensor("output.weight", output)
    for layer in range(shape.layers):
        prefix = f"blk.{layer}."
        writer.add_tensor(prefix + "attn_norm.weight", np.ones(n, dtype=np.float32))
        for name in ("attn_q", "attn_k", "attn_v"):
            writer.add_tensor(prefix + name + ".weight", matrix(n, n, "reads"))
        writer.add_tensor(prefix + "attn_output.weight", matrix(n, n, "writes"))
        writer.add_tensor(prefix + "ffn_norm.weight", np.ones(n, dtype=np.float32))
        writer.add_tensor(prefix + "ffn_gate.weight", matrix(ff, n, "reads"))
        writer.add_tensor(prefix + "ffn_up.weight", matrix(ff, n, "reads"))
        writer.add_tensor(prefix + "ffn_down.weight", matrix(n, ff, "writes"))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


class LlamaServer(BackendProcess):
    """One llama-server process on a loopback port, stopped by its PID."""

    name = "llama-server"

    @classmethod
    def start(cls, binary: Path, model: Path, log: Path, *extra: str, within: float = 60.0) -> LlamaServer:
        port = free_port()
        args = [
            str(binary), "-m", str(model), "--host", "127.0.0.1", "--port", str(port), "--metrics",
            "--ctx-size", "512", "--parallel", "1", "--threads", "2", "--seed", "42", "--no-webui", *extra,
        ]
        return cls.launch(args, port, log, model, within=within)


def parse_metric(text: str, name: str) -> float:
    """One unlabelled sample of a Prometheus text page (llama-server's names contain a colon)."""
    for line in text.splitlines():
        if line.startswith(name + " ") or line.startswith(name + "{"):
            return float(line.rsplit(" ", 1)[1])
    raise KeyError(name)

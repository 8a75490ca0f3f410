"""Train moeswap's built-in default model: a small Mixtral-family MoE, from scratch, on CPU.

Corpus: the Python standard library's own source (every machine has it; PSF licence), split by
file: every 20th file is held out (5 %). Tokenizer: byte-level BPE trained here with
`tokenizers`, GPT-2 pre-tokenisation (llama.cpp's `gpt-2` pre-tokenizer), 4096 tokens.
The model is transformers' own MixtralForCausalLM, so its router loss (load balancing) and its
saved folder are the reference implementation's; `--dense` trains LlamaForCausalLM with the same
active parameters (FFN width = top_k x expert width) for the comparison the model card reports.

    python training/train.py --out training/runs/moe --minutes 60
    python training/train.py --out training/runs/dense --minutes 60 --dense

Training is budgeted by wall-clock time (the learning-rate schedule follows elapsed time), so a
slower machine trains for fewer steps; every step's loss and each evaluation go to log.jsonl.
"""

from __future__ import annotations

import argparse
import json
import math
import sysconfig
import time
from pathlib import Path

import numpy as np
import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

END_OF_TEXT = "<|endoftext|>"
VOCAB_SIZE = 4096
HELD_OUT_EVERY = 20  # every 20th file: 5 % of the corpus


def corpus_files() -> list[Path]:
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    skip = {"site-packages", "test", "tests", "idlelib", "lib2to3", "__pycache__"}
    return sorted(p for p in stdlib.rglob("*.py") if not skip & set(p.relative_to(stdlib).parts))


def split_corpus(files: list[Path]) -> tuple[list[str], list[str]]:
    texts = [p.read_text(encoding="utf-8", errors="replace") for p in files]
    train = [t for i, t in enumerate(texts) if i % HELD_OUT_EVERY]
    held_out = [t for i, t in enumerate(texts) if i % HELD_OUT_EVERY == 0]
    return train, held_out


def train_tokenizer(texts: list[str]) -> Tokenizer:
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB_SIZE, special_tokens=[END_OF_TEXT],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tokenizer.train_from_iterator(texts, trainer)
    return tokenizer


def encode(tokenizer: Tokenizer, texts: list[str]) -> np.ndarray:
    eot = tokenizer.token_to_id(END_OF_TEXT)
    ids: list[int] = []
    for encoding in tokenizer.encode_batch(texts):
        ids.extend(encoding.ids)
        ids.append(eot)
    return np.asarray(ids, dtype=np.int64)


def build_model(dense: bool, eot: int, resume: Path | None = None):
    from transformers import LlamaConfig, LlamaForCausalLM, MixtralConfig, MixtralForCausalLM

    if resume is not None:  # continue a finished run (its optimizer state is not kept)
        return (LlamaForCausalLM if dense else MixtralForCausalLM).from_pretrained(resume)

    common = dict(vocab_size=VOCAB_SIZE, hidden_size=256, num_hidden_layers=6,
                  num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=1024,
                  rms_norm_eps=1e-5, rope_theta=10000.0, tie_word_embeddings=False,
                  bos_token_id=eot, eos_token_id=eot)
    if dense:
        return LlamaForCausalLM(LlamaConfig(intermediate_size=2 * 256, **common))
    config = MixtralConfig(intermediate_size=256, num_local_experts=16, num_experts_per_tok=2,
                           output_router_logits=True, router_aux_loss_coef=0.02, **common)
    return MixtralForCausalLM(config)


def per_layer_balance_loss(router_logits: tuple[torch.Tensor, ...], k: int,
                           floor_coef: float) -> torch.Tensor:
    """Switch-Transformer load balancing computed per layer, plus a floor term, averaged.

    transformers' Mixtral loss pools the counts of all layers, which lets single layers starve
    experts (we saw layers where some experts got no held-out tokens at all). The Switch term's
    gradient on a starved expert's probability is proportional to its (tiny) share, so it barely
    revives it; the floor term KL(uniform || mean router distribution) grows like -log(share) and
    does, while leaving each token's routing free to be sharp.
    Legend: N tokens, E experts.
    """
    losses = []
    for logits in router_logits:  # [N, E] each
        probs = logits.float().softmax(dim=-1)  # [N, E]
        chosen = torch.zeros_like(probs).scatter_(1, probs.topk(k, dim=-1).indices, 1.0)  # [N, E]
        n_experts = probs.shape[-1]
        mean_probs = probs.mean(0)  # [E]
        switch = n_experts * (chosen.mean(0) / k * mean_probs).sum()
        floor = -(mean_probs * n_experts).log().mean()  # 0 when the mean routing is uniform
        losses.append(switch + floor_coef * floor)
    return torch.stack(losses).mean()


def batches(ids: np.ndarray, seq_len: int, batch: int, rng: np.random.Generator):
    while True:
        starts = rng.integers(0, len(ids) - seq_len - 1, size=batch)
        window = np.stack([ids[s: s + seq_len + 1] for s in starts])  # [B, S+1]
        yield torch.from_numpy(window)


@torch.no_grad()
def held_out_loss(model, ids: np.ndarray, seq_len: int, n_windows: int = 48) -> float:
    """Mean next-token loss over fixed, evenly spaced windows of the held-out text."""
    model.eval()
    starts = np.linspace(0, len(ids) - seq_len - 1, n_windows).astype(np.int64)
    losses = []
    for chunk in np.array_split(starts, 6):
        window = torch.from_numpy(np.stack([ids[s: s + seq_len + 1] for s in chunk]))
        logits = model(input_ids=window[:, :-1]).logits  # [B, S, V]
        losses.append(torch.nn.functional.cross_entropy(
            logits.reshape(-1, logits.shape[-1]), window[:, 1:].reshape(-1)).item())
    model.train()
    return float(np.mean(losses))


def unigram_loss(train_ids: np.ndarray, held_ids: np.ndarray) -> float:
    counts = np.bincount(train_ids, minlength=VOCAB_SIZE).astype(np.float64) + 1.0
    log_p = np.log(counts / counts.sum())
    return float(-log_p[held_ids].mean())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--minutes", type=float, default=60.0)
    parser.add_argument("--dense", action="store_true")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--lr", type=float, default=2e-3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--resume", type=Path, help="a previous run's hf/ folder to continue")
    parser.add_argument("--balance-coef", type=float, default=0.05,
                        help="weight of the per-layer load-balancing loss (MoE only)")
    parser.add_argument("--floor-coef", type=float, default=1.0,
                        help="weight of the floor term inside the per-layer balance loss")
    args = parser.parse_args()
    torch.manual_seed(args.seed)
    torch.set_num_threads(args.threads)
    args.out.mkdir(parents=True, exist_ok=True)

    train_texts, held_texts = split_corpus(corpus_files())
    tokenizer = train_tokenizer(train_texts)
    train_ids, held_ids = encode(tokenizer, train_texts), encode(tokenizer, held_texts)
    eot = tokenizer.token_to_id(END_OF_TEXT)
    model = build_model(args.dense, eot, args.resume)
    n_params = sum(p.numel() for p in model.parameters())
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.1,
                                  betas=(0.9, 0.95))
    budget_s = args.minutes * 60
    log = (args.out / "log.jsonl").open("w")
    meta = dict(kind="dense" if args.dense else "moe", params=n_params, train_tokens=len(train_ids),
                held_out_tokens=len(held_ids), unigram_held_out_loss=unigram_loss(train_ids, held_ids),
                **{k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()})
    log.write(json.dumps(meta) + "\n")
    print(json.dumps(meta), flush=True)

    rng = np.random.default_rng(args.seed)
    start = time.monotonic()
    next_eval = 0.0
    step = 0
    for window in batches(train_ids, args.seq_len, args.batch, rng):
        elapsed = time.monotonic() - start
        if elapsed >= next_eval or elapsed >= budget_s:
            record = dict(step=step, minutes=elapsed / 60,
                          held_out_loss=held_out_loss(model, held_ids, args.seq_len))
            log.write(json.dumps(record) + "\n")
            log.flush()
            print(json.dumps(record), flush=True)
            next_eval += budget_s / 12
        if elapsed >= budget_s:
            break
        # Warm up for 2 % of the budget, then cosine decay to 10 % of the peak, by elapsed time.
        progress = elapsed / budget_s
        scale = min(1.0, progress / 0.02) * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))
        for group in optimizer.param_groups:
            group["lr"] = args.lr * scale
        out = model(input_ids=window, labels=window)  # the model shifts labels itself
        loss = out.loss  # for the MoE this includes transformers' pooled load-balancing term
        if not args.dense and args.balance_coef:
            loss = loss + args.balance_coef * per_layer_balance_loss(out.router_logits, 2,
                                                                      args.floor_coef)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        step += 1
        if step % 20 == 0:
            log.write(json.dumps(dict(step=step, minutes=elapsed / 60, loss=loss.item())) + "\n")
    log.close()

    from transformers import PreTrainedTokenizerFast

    model.save_pretrained(args.out / "hf")
    PreTrainedTokenizerFast(tokenizer_object=tokenizer, bos_token=END_OF_TEXT,
                            eos_token=END_OF_TEXT, unk_token=None).save_pretrained(args.out / "hf")


if __name__ == "__main__":
    main()

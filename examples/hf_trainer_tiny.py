"""Hugging Face ``transformers.Trainer`` unchanged under phalanxrun, with DeepSpeed ZeRO on CPU.

A 2-layer GPT-2 built from a config in code learns a short text with a character tokenizer written here:
nothing is downloaded (run with ``HF_HUB_OFFLINE=1``). The script never imports phalanx; the Trainer finds its
rank in the variables phalanxrun sets, as under torchrun:

    HF_HUB_OFFLINE=1 phalanxrun -np 2 python examples/hf_trainer_tiny.py [--steps 30] [--zero-stage 2]

Rank 0 prints the first and the last step's loss and a sample continuation.
"""

from __future__ import annotations

import argparse
import tempfile
from typing import Any

TEXT = "the quick brown fox jumps over the lazy dog. " * 16
CHARS = sorted(set(TEXT))
BLOCK = 24


class CharTokenizer:
    """One id per character of :data:`TEXT`."""

    def encode(self, text: str) -> list[int]:
        return [CHARS.index(c) for c in text]

    def decode(self, ids: list[int]) -> str:
        return "".join(CHARS[i] for i in ids)


def dataset(tokenizer: CharTokenizer) -> list[dict[str, Any]]:
    """Overlapping blocks of the text, each its own label (the model shifts them)."""
    import torch

    ids = tokenizer.encode(TEXT)
    return [{"input_ids": torch.tensor(ids[i:i + BLOCK]), "labels": torch.tensor(ids[i:i + BLOCK])}
            for i in range(0, len(ids) - BLOCK, BLOCK // 3)]


def tiny_gpt2() -> Any:
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    config = GPT2Config(vocab_size=len(CHARS), n_positions=BLOCK, n_embd=64, n_layer=2, n_head=2,
                        bos_token_id=0, eos_token_id=0)
    return GPT2LMHeadModel(config)


def ds_config(zero_stage: int) -> dict[str, Any]:
    """DeepSpeed for CPU: ZeRO ``zero_stage``, torch's AdamW; the Trainer fills the ``"auto"`` values."""
    return {"train_micro_batch_size_per_gpu": "auto", "train_batch_size": "auto",
            "gradient_accumulation_steps": "auto", "zero_optimization": {"stage": zero_stage},
            "optimizer": {"type": "AdamW", "params": {"lr": "auto", "torch_adam": True}}}


def main(argv: list[str] | None = None) -> dict[str, float]:
    from transformers import Trainer, TrainingArguments

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--zero-stage", type=int, default=2, choices=(0, 1, 2, 3), help="0: no DeepSpeed")
    args = parser.parse_args(argv)
    tokenizer = CharTokenizer()
    data = dataset(tokenizer)
    with tempfile.TemporaryDirectory() as out:
        training = TrainingArguments(output_dir=out, per_device_train_batch_size=4, max_steps=args.steps,
                                     learning_rate=5e-3, save_strategy="no", report_to=[], use_cpu=True,
                                     logging_steps=1, disable_tqdm=True,
                                     deepspeed=ds_config(args.zero_stage) if args.zero_stage else None)
        trainer = Trainer(model=tiny_gpt2(), args=training, train_dataset=data)
        trainer.train()
    losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
    before, after = losses[0], losses[-1]
    if training.process_index == 0:
        import torch

        model: Any = trainer.model
        model.eval()
        prompt = torch.tensor([tokenizer.encode("the quick ")])
        with torch.no_grad():
            sample = model.generate(prompt, max_new_tokens=12, do_sample=False, pad_token_id=0)
        print(f"ranks: {training.world_size}; loss first step: {before:.3f}; last step: {after:.3f}; "
              f"sample: {tokenizer.decode(sample[0].tolist())!r}", flush=True)
    return {"before": before, "after": after}


if __name__ == "__main__":
    main()

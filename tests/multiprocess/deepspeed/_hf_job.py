"""Hugging Face training as users write it, for the launchers' tests: an ``accelerate.Accelerator`` loop, then
``transformers.Trainer`` with ``TrainingArguments(deepspeed=...)`` (ZeRO 2), on a 2-layer GPT-2 built from a
config in code and a character tokenizer written here: nothing is downloaded (``HF_HUB_OFFLINE=1``).

Run as a script it prints one ``HF {json}`` line per rank.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
from typing import Any

TEXT = "the quick brown fox jumps over the lazy dog. " * 8
CHARS = sorted(set(TEXT))
BLOCK = 16
#: The variables accelerate and transformers read to place a rank (accelerate.utils.environment, state.py).
PLACEMENT = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
             "ACCELERATE_USE_DEEPSPEED", "ACCELERATE_USE_CPU")


def encode(text: str) -> list[int]:
    return [CHARS.index(c) for c in text]


def blocks() -> list[dict[str, Any]]:
    import torch

    ids = encode(TEXT)
    out = []
    for start in range(0, len(ids) - BLOCK, BLOCK // 2):
        chunk = torch.tensor(ids[start:start + BLOCK])
        out.append({"input_ids": chunk, "labels": chunk.clone()})
    return out


def tiny_gpt2() -> Any:
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    return GPT2LMHeadModel(GPT2Config(vocab_size=len(CHARS), n_positions=BLOCK, n_embd=32, n_layer=2, n_head=2,
                                      bos_token_id=0, eos_token_id=0))


def with_accelerate(steps: int = 3) -> dict[str, Any]:
    import torch
    from accelerate import Accelerator

    accelerator = Accelerator(cpu=True)
    model = tiny_gpt2()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    loader = torch.utils.data.DataLoader(blocks(), batch_size=2, shuffle=False)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    losses = []
    for step, batch in enumerate(loader):
        if step == steps:
            break
        loss = model(**batch).loss
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    total = torch.stack([p.detach().sum() for p in model.parameters()]).sum().reshape(1)
    sums = accelerator.gather(total).tolist()
    state = accelerator.state
    return {"num_processes": state.num_processes, "process_index": state.process_index,
            "local_process_index": state.local_process_index, "distributed_type": str(state.distributed_type),
            "losses": losses, "param_sums": sums, "batches": len(loader)}


def with_trainer(steps: int = 3) -> dict[str, Any]:
    from transformers import Trainer, TrainingArguments

    ds = {"train_micro_batch_size_per_gpu": "auto", "train_batch_size": "auto",
          "gradient_accumulation_steps": "auto", "zero_optimization": {"stage": 2},
          "optimizer": {"type": "AdamW", "params": {"lr": "auto", "torch_adam": True}}}
    with tempfile.TemporaryDirectory() as out:
        args = TrainingArguments(output_dir=out, per_device_train_batch_size=2, max_steps=steps, learning_rate=1e-2,
                                 logging_steps=1, save_strategy="no", report_to=[], use_cpu=True, deepspeed=ds,
                                 disable_tqdm=True)
        trainer = Trainer(model=tiny_gpt2(), args=args, train_dataset=blocks())
        result = trainer.train()
    return {"world_size": args.world_size, "process_index": args.process_index,
            "local_process_index": args.local_process_index, "steps": result.global_step,
            "loss": result.training_loss, "deepspeed": trainer.is_deepspeed_enabled}


def main() -> None:
    accelerate = with_accelerate()
    from accelerate.state import AcceleratorState

    AcceleratorState._reset_state(reset_partial_state=True)  # the Trainer builds its own, with DeepSpeed
    record = {"accelerate": accelerate, "trainer": with_trainer(),
              "env": {k: os.environ.get(k) for k in PLACEMENT}}
    print("HF " + json.dumps(record), flush=True)


if __name__ == "__main__":
    sys.exit(main())

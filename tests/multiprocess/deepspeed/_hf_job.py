"""Hugging Face training as users write it, for the launchers' tests: an ``accelerate.Accelerator`` loop on a
2-layer GPT-2 built from a config in code and a character tokenizer written here: nothing is downloaded
(``HF_HUB_OFFLINE=1``). ``transformers.Trainer`` with ``TrainingArguments(deepspeed=...)`` is
examples/hf_trainer_tiny.py, tested in the examples tier.

Run as a script it prints one ``HF {json}`` line per rank.
"""

from __future__ import annotations

import json
import os
import sys
from typing import Any

TEXT = "the quick brown fox jumps over the lazy dog. " * 8
CHARS = sorted(set(TEXT))
BLOCK = 16
#: The variables accelerate and transformers read to place a rank (accelerate.utils.environment, state.py).
PLACEMENT = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


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


def main() -> None:
    record = {"accelerate": with_accelerate(), "env": {k: os.environ.get(k) for k in PLACEMENT}}
    print("HF " + json.dumps(record), flush=True)


if __name__ == "__main__":
    sys.exit(main())

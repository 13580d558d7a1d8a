"""Randomized clipping on several processes: DDP or FSDP2, launched with torchrun.

A small, self-contained training run (docs/distributed.md explains each step)::

    # CPU, 2 processes, gloo (what CI runs)
    torchrun --nproc-per-node 2 tutorials/distributed_training.py --parallel fsdp
    torchrun --nproc-per-node 2 tutorials/distributed_training.py --parallel ddp
    torchrun --nproc-per-node 2 tutorials/distributed_training.py --parallel trainer-fsdp
    # GPUs, one process per GPU, NCCL
    torchrun --nproc-per-node 2 tutorials/distributed_training.py --parallel fsdp --backend nccl
    torchrun --nproc-per-node 8 tutorials/distributed_training.py --parallel trainer-fsdp \
        --backend nccl

``--parallel trainer-fsdp`` is the Hugging Face Trainer's way (:func:`trainer_fsdp`): a tied
tiny Llama, every weight trainable (RMSNorms and the tied embedding / LM head included), fine-
tuned by ``DPTrainer`` with ``TrainingArguments(fsdp=True, fsdp_config={"fsdp_version": 2})``.

Every rank builds the same model (same seed), wraps it (DDP, or FSDP2 with Opacus'
``FSDP2Wrapper``), and calls ``make_private`` exactly as in one process. The engine picks the
distributed Poisson loader (each rank samples its shard of the data; an empty batch is a
noise-only step that every rank takes), the distributed optimizer (noise added once, gradients
summed over ranks) and the module for the model. Rank 0 prints the loss and epsilon; every
rank's accountant holds the same steps.
"""

from __future__ import annotations

import argparse
import os
import time
import warnings

import torch
import torch.distributed as dist
from opacus.utils.fsdp_utils import FSDP2Wrapper
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, TensorDataset

from opacus_rc import PrivacyEngine


class TinyTransformerBlock(nn.Module):
    """Embedding, one MLP block with a residual, mean-pooled classifier head."""

    def __init__(self, vocab: int = 256, d: int = 64, classes: int = 4) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, d)
        self.norm = nn.LayerNorm(d)
        self.up = nn.Linear(d, 4 * d)
        self.down = nn.Linear(4 * d, d)
        self.head = nn.Linear(d, classes)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.embed(tokens)
        h = h + self.down(torch.relu(self.up(self.norm(h))))
        return self.head(h.mean(1))


def trainer_fsdp(*, backend: str, steps: int, seq_len: int) -> None:
    """Full fine-tuning of a tied tiny Llama under FSDP2 through ``DPTrainer``.

    The script is the single-process one; ``fsdp=True, fsdp_config={"fsdp_version": 2}`` makes
    it FSDP2 when launched on several processes (accelerate starts the process group: gloo on
    CPU, NCCL on GPUs). The DP trainer shards the model itself before making it private, as
    accelerate's auto-wrap policy says (each ``LlamaDecoderLayer``, then the root, which keeps
    the tied embedding / LM head), draws one Poisson logical batch per step over the whole
    dataset and trains each rank on its share (every rank runs as many micro-batches as the
    busiest one), noises the clipped sum once and accounts one step on every rank.

    **What to change on GPUs**: launch one process per GPU (``torchrun --nproc-per-node 8``, or
    ``accelerate launch`` with an FSDP config of ``fsdp_version: 2``) and drop ``use_cpu``;
    NCCL is then the backend. A real model comes from ``from_pretrained`` (every rank loads the
    same weights; ``cpu_ram_efficient_loading`` is refused); ``fsdp_config`` keys that apply:
    ``transformer_layer_cls_to_wrap`` (the decoder layer class, by default the model's
    ``_no_split_modules``), ``reshard_after_forward``, and ``state_dict_type``
    (``SHARDED_STATE_DICT`` writes each rank's shard at a checkpoint; ``save_model`` writes the
    full model either way). Refused under FSDP2, with what to change: ``bf16``/``fp16`` mixed
    precision, ``fsdp_config["activation_checkpointing"]`` (``gradient_checkpointing=True``
    works), CPU offload, FSDP version 1,
    ``PrivacyArguments.privacy_unit`` (docs/distributed.md).
    """
    import transformers

    from opacus_rc.integrations.transformers import DPTrainer, PrivacyArguments

    config = transformers.LlamaConfig(
        vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2 * seq_len,
        tie_word_embeddings=True, pad_token_id=0, use_cache=False,
    )  # fmt: skip
    torch.manual_seed(0)  # the same weights on every rank
    model = transformers.LlamaForCausalLM(config)
    assert model.lm_head.weight is model.model.embed_tokens.weight  # tied
    assert all(p.requires_grad for p in model.parameters())  # every weight trainable

    g = torch.Generator().manual_seed(1)
    records = []
    for _ in range(256):  # token sequences of 4 .. seq_len tokens: the batches are padded
        length = int(torch.randint(4, seq_len + 1, (1,), generator=g))
        records.append({"input_ids": torch.randint(1, 256, (length,), generator=g).tolist()})

    def collate(rows: list[dict]) -> dict[str, torch.Tensor]:
        """Right padding; labels = input ids, -100 on padding."""
        t = max(len(r["input_ids"]) for r in rows)
        ids = torch.zeros((len(rows), t), dtype=torch.long)
        mask = torch.zeros_like(ids)
        for i, r in enumerate(rows):
            ids[i, : len(r["input_ids"])] = torch.tensor(r["input_ids"])
            mask[i, : len(r["input_ids"])] = 1
        return {
            "input_ids": ids,
            "attention_mask": mask,
            "labels": ids.masked_fill(mask == 0, -100),
        }

    out = "distributed_training_trainer_fsdp"
    args = transformers.TrainingArguments(
        output_dir=out,
        fsdp=True,
        fsdp_config={"fsdp_version": 2},  # GPUs: add e.g. "state_dict_type": "SHARDED_STATE_DICT"
        use_cpu=backend == "gloo",
        per_device_train_batch_size=8,  # the memory limit: micro-batches of at most 8 examples
        max_steps=steps,
        optim="adamw_torch",
        learning_rate=3e-3,
        max_grad_norm=0.0,  # the Trainer's own clipping of the sum is not used
        logging_steps=max(1, steps // 2),
        save_strategy="no",
        report_to=[],
        disable_tqdm=True,
        remove_unused_columns=False,
    )
    privacy = PrivacyArguments(
        target_epsilon=8.0, target_delta=1e-5, expected_batch_size=32, max_grad_norm=1.0
    )
    trainer = DPTrainer(
        model=model,
        args=args,
        train_dataset=records,
        data_collator=collate,
        privacy_args=privacy,
    )
    start = time.perf_counter()
    trainer.train()
    trainer.save_model(out)  # the full model, gathered from the shards (rank 0 writes it)
    if trainer.args.process_index == 0:
        print(
            f"{type(trainer.dp_optimizer).__name__}: {len(trainer.privacy_engine.accountant)} "
            f"steps accounted, epsilon {trainer.get_epsilon():.2f} "
            f"(target {privacy.target_epsilon}), noise multiplier "
            f"{trainer.dp_optimizer.noise_multiplier:.3f}, "
            f"{time.perf_counter() - start:.1f} s; full model saved to {out}/",
            flush=True,
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--parallel", choices=("ddp", "fsdp", "trainer-fsdp"), default="fsdp")
    parser.add_argument("--backend", choices=("gloo", "nccl"), default="gloo")
    parser.add_argument("--steps-per-epoch", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=32)
    args = parser.parse_args()
    if args.parallel == "trainer-fsdp":  # accelerate starts the process group
        # PyTorch warns at every step that the FSDP2 root "returned a view tensor": the logits,
        # the tied LM head's output, which the per-sample backward hook returns as a view. An
        # in-place op on it raises instead of dropping FSDP2's hook (docs/distributed.md, "the
        # returned a view tensor warning"), so it is silenced for that class only.
        warnings.filterwarnings(
            "ignore",
            message=r"FSDP2-wrapped module \(FSDPLlamaForCausalLM\) returned a view tensor",
            category=UserWarning,
        )
        if args.backend == "gloo":
            torch.set_num_threads(1)
        trainer_fsdp(backend=args.backend, steps=args.steps_per_epoch, seq_len=args.seq_len)
        return

    dist.init_process_group(args.backend)
    rank = dist.get_rank()
    if args.backend == "nccl":
        device = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
        torch.set_num_threads(1)

    # Same data and initial weights on every rank; each rank samples its own shard.
    torch.manual_seed(0)
    n = 64 * args.steps_per_epoch
    tokens = torch.randint(0, 256, (n, args.seq_len))
    labels = tokens[:, 0] % 4  # learnable: the class is in the first token
    loader = DataLoader(TensorDataset(tokens, labels), batch_size=64)
    model = TinyTransformerBlock().to(device)
    if args.parallel == "ddp":
        model = DistributedDataParallel(
            model, device_ids=[device] if device.type == "cuda" else None
        )
    else:
        model = FSDP2Wrapper(model)  # fully_shard on every layer, then on the model
        # PyTorch warns at every step that FSDPLinear and FSDPTinyTransformerBlock "returned a
        # view tensor" (an in-place op on such a view would drop FSDP2's pre-backward hook).
        # Here that cannot happen, so the warning is silenced for these two classes only: the
        # views are nn.Linear's output on (B, T, d) inputs (F.linear views its 2-D product
        # back) and the model's output (the head's, which the per-sample backward hook
        # returns as a view). The caller of a hooked layer sees the hook's output, not the
        # view, and an in-place op on the hook's output raises instead of dropping anything.
        # tests/distributed/fsdp_worker.py (scenario_view_warning) checks both and that the
        # update equals the single-process per-sample oracle's; docs/distributed.md.
        warnings.filterwarnings(
            "ignore",
            message=r"FSDP2-wrapped module \((FSDPLinear|FSDPTinyTransformerBlock)\) returned "
            r"a view tensor",
            category=UserWarning,
        )

    engine = PrivacyEngine()
    model, optimizer, criterion, loader = engine.make_private(
        module=model,
        optimizer=torch.optim.Adam(model.parameters(), lr=3e-3),
        data_loader=loader,
        noise_multiplier=1.0,
        max_grad_norm=1.0,
        clipping="randomized",
        sketch_dim=32,
    )
    # The ranks were seeded alike (same model); each rank's Poisson sampler derived its own
    # generator from the seed and its rank, so the shards are sampled independently, as
    # single-process Poisson sampling samples every record (opacus_rc.data_loader). Seed the
    # rest of each rank's run (dropout, noise draws) per rank.
    torch.manual_seed(1000 + rank)

    start = time.perf_counter()
    for epoch in range(2):
        for x, y in loader:
            x, y = x.to(device), y.to(device)
            loss = criterion(model(x), y)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
        if rank == 0:
            print(
                f"epoch {epoch}: last loss {loss.item():.3f}, "
                f"epsilon {engine.get_epsilon(delta=1e-5):.2f}, "
                f"{len(engine.accountant)} steps accounted, "
                f"{time.perf_counter() - start:.1f} s",
                flush=True,
            )
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

#!/usr/bin/env python3
"""PyTorch 1.13 peer of examples/gpt: the same model, data, batch and optimizer, the PyTorch way.

Model    GPT-2's architecture as examples/gpt builds it (tensor/nn/gpt.h), with the same
         parameter names: wte, wpe, h.<i>.{ln_1, attn.c_attn, attn.c_proj, ln_2, mlp.c_fc,
         mlp.c_proj}, ln_f, and the output layer tied to wte. Attention is written out as
         PyTorch 1.13 has no fused kernel: q @ k^T * scale, masked_fill of a causal mask,
         softmax, dropout, @ v. --init FILE loads initial weights from a safetensors file
         (examples/gpt --init-out writes one), so both sides start from the same values.
Data     Debian's fortunes split exactly as data/text.h does (a fortune is a document; the
         FNV-1a hash of its bytes picks validation), byte tokens, and the same random windows:
         step s, global slot j is draw s*G + j of dtrain's counter-based splitmix64 stream;
         rank r takes slots r, r + W, ...
Step     AdamW(betas 0.9/0.95) with weight decay on the Linear weights only, warm-up + cosine
         learning rate, clip_grad_norm_(1.0), DDP over gloo (default 25 MB buckets) when
         launched with RANK set (world 1 included); torch.set_num_threads(1).
Precision --precision bf16 runs each forward and the loss under
         torch.cpu.amp.autocast(dtype=torch.bfloat16) (PyTorch's own mixed precision: its Linear
         and matmuls go to oneDNN's bf16 kernels), backward outside it as PyTorch prescribes;
         weights and AdamW stay fp32; the validation loss is measured in fp32 (as examples/gpt).
Timing   --bench-warmup steps, a barrier, the rest timed (data included, as in examples/gpt);
         tokens_per_s = timed steps x global batch x T / rank 0's time. peak_rss_mb: the largest
         VmHWM over the ranks. val_loss_nats: the mean loss over the first --eval-windows windows
         at stride T of the validation text after the last step (examples/gpt's evaluation).

  /usr/bin/python3 bench/peers/torchrun_py311.py --nproc_per_node 4 --standalone bench/peers/torch_gpt.py

Rank 0 prints (the same keys as `gpt --bench`):

  RESULT gpt impl=torch world=4 global_batch=16 model=L4-H4-C256-T128 steps=.. step_ms=.. tokens_per_s=.. peak_rss_mb=.. val_loss_nats=.. precision=fp32

--micro block|attention instead times the forward and backward of one transformer block, or of
the attention core (fused qkv in, merged heads out), on random [batch, T, C] inputs: median of
--reps, one process:

  RESULT gpt_block impl=torch batch=4 model=... step_ms=..     RESULT gpt_attention impl=torch ...

The model, the safetensors reader/writer and the fortunes split are also what
tests/tensor/gpt_torch_reference.py imports for the forward/backward comparison test.
"""
import argparse
import json
import math
import os
import statistics
import struct
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

FORTUNES = "/usr/share/games/fortunes"
MASK64 = (1 << 64) - 1


# ---- safetensors (the format, written from its specification) --------------------------------

DTYPES = {"F32": torch.float32, "F64": torch.float64, "I64": torch.int64, "I32": torch.int32}
NAMES = {v: k for k, v in DTYPES.items()}


def load_safetensors(path):
    with open(path, "rb") as f:
        raw = f.read()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8:8 + n])
    out = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        begin, end = info["data_offsets"]
        data = bytearray(raw[8 + n + begin:8 + n + end])
        t = torch.frombuffer(data, dtype=DTYPES[info["dtype"]]) if data else torch.empty(0, dtype=DTYPES[info["dtype"]])
        out[name] = t.reshape(info["shape"]).clone()
    return out


def save_safetensors(path, tensors):
    header, blobs, offset = {}, [], 0
    for name, t in tensors.items():
        t = t.detach().contiguous().cpu()
        blob = t.numpy().tobytes()
        header[name] = {"dtype": NAMES[t.dtype], "shape": list(t.shape), "data_offsets": [offset, offset + len(blob)]}
        blobs.append(blob)
        offset += len(blob)
    text = json.dumps(header).encode()
    text += b" " * ((8 - len(text) % 8) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(text)) + text + b"".join(blobs))


# ---- the model ------------------------------------------------------------------------------

class CausalSelfAttention(nn.Module):
    def __init__(self, width, heads, context, dropout):
        super().__init__()
        self.c_attn = nn.Linear(width, 3 * width)
        self.c_proj = nn.Linear(width, width)
        self.heads, self.width, self.dropout = heads, width, dropout
        # A plain attribute, not a buffer: DDP would broadcast a buffer, and gloo has no bool broadcast.
        self.mask = torch.tril(torch.ones(context, context, dtype=torch.bool))

    def core(self, qkv):
        """[B, T, 3C] -> [B, T, C]: split, heads, masked softmax attention, merge."""
        b, t, _ = qkv.shape
        q, k, v = qkv.split(self.width, dim=2)
        shape = (b, t, self.heads, self.width // self.heads)
        q, k, v = (z.view(shape).transpose(1, 2) for z in (q, k, v))
        att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(k.size(-1)))
        att = att.masked_fill(~self.mask[:t, :t], float("-inf"))
        att = F.dropout(F.softmax(att, dim=-1), self.dropout, self.training)
        return (att @ v).transpose(1, 2).contiguous().view(b, t, self.width)

    def forward(self, x):
        return F.dropout(self.c_proj(self.core(self.c_attn(x))), self.dropout, self.training)


class Mlp(nn.Module):
    def __init__(self, width, dropout):
        super().__init__()
        self.c_fc = nn.Linear(width, 4 * width)
        self.c_proj = nn.Linear(4 * width, width)
        self.dropout = dropout

    def forward(self, x):
        return F.dropout(self.c_proj(F.gelu(self.c_fc(x))), self.dropout, self.training)


class Block(nn.Module):
    def __init__(self, width, heads, context, dropout):
        super().__init__()
        self.ln_1 = nn.LayerNorm(width)
        self.attn = CausalSelfAttention(width, heads, context, dropout)
        self.ln_2 = nn.LayerNorm(width)
        self.mlp = Mlp(width, dropout)

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class Gpt(nn.Module):
    def __init__(self, vocab=256, context=128, layers=4, heads=4, width=256, dropout=0.0):
        super().__init__()
        self.wte = nn.Embedding(vocab, width)
        self.wpe = nn.Embedding(context, width)
        self.h = nn.Sequential(*[Block(width, heads, context, dropout) for _ in range(layers)])
        self.ln_f = nn.LayerNorm(width)
        self.dropout = dropout
        for name, p in self.named_parameters():  # GPT-2's initialisation
            if ".ln_" in name or name.startswith("ln_f"):
                continue
            if name.endswith(".bias"):
                nn.init.zeros_(p)
            elif name.endswith("c_proj.weight"):
                nn.init.normal_(p, 0.0, 0.02 / math.sqrt(2 * layers))
            else:
                nn.init.normal_(p, 0.0, 0.02)

    def forward(self, tokens):
        t = tokens.size(1)
        x = self.wte(tokens) + self.wpe(torch.arange(t, device=tokens.device))
        x = self.ln_f(self.h(F.dropout(x, self.dropout, self.training)))
        return F.linear(x, self.wte.weight)  # tied output layer


def lm_loss(logits, targets):
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1))


def decay_groups(model, weight_decay):
    """Linear weights decay; biases, LayerNorms and embeddings (the tied head among them) do not."""
    linear = {id(m.weight) for m in model.modules() if isinstance(m, nn.Linear)}
    decay = [p for p in model.parameters() if id(p) in linear]
    rest = [p for p in model.parameters() if id(p) not in linear]
    return [{"params": decay, "weight_decay": weight_decay}, {"params": rest, "weight_decay": 0.0}]


# ---- the data (data/text.h, the same bytes and windows) ------------------------------------------

def fnv1a(data):
    h = 0xcbf29ce484222325
    for c in data:
        h = ((h ^ c) * 0x100000001b3) & MASK64
    return h


def fortunes_split(folder=FORTUNES, share=0.05):
    docs = []
    for name in sorted(os.listdir(folder)):
        path = os.path.join(folder, name)
        if os.path.islink(path) or not os.path.isfile(path) or name.endswith(".dat"):
            continue
        with open(path, "rb") as f:
            text = f.read()
        entry = b""
        lines = text.split(b"\n")
        if text.endswith(b"\n"):
            lines = lines[:-1]
        for line in lines:
            if line == b"%":
                if entry.strip(b" \t\n"):
                    docs.append(entry + b"%\n")
                entry = b""
            else:
                entry += line + b"\n"
        if entry.strip(b" \t\n"):
            docs.append(entry + b"%\n")
    threshold = int(share * 18446744073709551615.0)
    train = b"".join(d for d in docs if fnv1a(d) >= threshold)
    val = b"".join(d for d in docs if fnv1a(d) < threshold)
    return train, val


def splitmix64(x):
    x = (x + 0x9e3779b97f4a7c15) & MASK64
    x = ((x ^ (x >> 30)) * 0xbf58476d1ce4e5b9) & MASK64
    x = ((x ^ (x >> 27)) * 0x94d049bb133111eb) & MASK64
    return x ^ (x >> 31)


def window_starts(seed, step, global_batch, world, rank, per_rank, windows):
    """dtrain's DistributedSampler with replacement: slot j of step s is draw s*G + j (counter-based) of seed's stream."""
    base = splitmix64(seed)
    out = []
    for i in range(per_rank):
        slot = rank + i * world
        counter = step * global_batch + slot + 1
        out.append(splitmix64((base + 0x9e3779b97f4a7c15 * counter) & MASK64) % windows)
    return out


def gather(data, starts, t):
    x = torch.stack([data[s:s + t] for s in starts]).long()
    y = torch.stack([data[s + 1:s + t + 1] for s in starts]).long()
    return x, y


def lr_at(step, peak, warmup, total, floor):
    if step < warmup:
        return peak * (step + 1) / warmup
    if step >= total:
        return floor
    progress = (step - warmup) / max(1, total - warmup)
    return floor + 0.5 * (1.0 + math.cos(math.pi * progress)) * (peak - floor)


def peak_rss_mib():
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024.0
    return 0.0


@torch.no_grad()
def validation_loss(model, val, t, count, world, rank):
    model.eval()
    available = min(count, (len(val) - t + t - 1) // t)
    mine = [w * t for w in range(rank, available, world)]
    loss_sum, tokens = 0.0, 0.0
    for begin in range(0, len(mine), 16):
        x, y = gather(val, mine[begin:begin + 16], t)
        logits = model(x)
        loss_sum += F.cross_entropy(logits.reshape(-1, logits.size(-1)), y.reshape(-1), reduction="sum").item()
        tokens += y.numel()
    model.train()
    sums = torch.tensor([loss_sum, tokens], dtype=torch.float64)
    if dist.is_initialized():
        dist.all_reduce(sums)
    return (sums[0] / sums[1]).item()


def median_ms(fn, reps):
    fn()
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        times.append(1e3 * (time.perf_counter() - start))
    return statistics.median(times)


def micro(args):
    torch.manual_seed(0)
    block = Block(args.width, args.heads, args.context, 0.0)
    x = torch.randn(args.batch, args.context, args.width, requires_grad=True)
    if args.micro == "block":
        def fn():
            block(x).sum().backward()
    else:
        qkv = torch.randn(args.batch, args.context, 3 * args.width, requires_grad=True)

        def fn():
            block.attn.core(qkv).sum().backward()
    ms = median_ms(fn, args.reps)
    print(f"RESULT gpt_{args.micro} impl=torch batch={args.batch} model=L1-H{args.heads}-C{args.width}-T{args.context} "
          f"reps={args.reps} step_ms={ms:.3f}", flush=True)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data", default=FORTUNES)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--context", type=int, default=128)
    parser.add_argument("--steps", type=int, default=250)
    parser.add_argument("--global-batch", type=int, default=16)
    parser.add_argument("--lr", type=float, default=2e-3)
    parser.add_argument("--min-lr", type=float, default=2e-4)
    parser.add_argument("--warmup", type=int, default=25)
    parser.add_argument("--weight-decay", type=float, default=0.1)
    parser.add_argument("--grad-clip", type=float, default=1.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--eval-windows", type=int, default=64)
    parser.add_argument("--bench-warmup", type=int, default=5)
    parser.add_argument("--init", help="safetensors file with the initial weights (examples/gpt --init-out)")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--micro", choices=("block", "attention"))
    parser.add_argument("--batch", type=int, default=4, help="--micro: sequences per forward")
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--precision", choices=("fp32", "bf16"), default="fp32",
                        help="bf16: forward and loss under torch.cpu.amp.autocast(dtype=torch.bfloat16)")
    parser.add_argument("--backend", default="gloo", choices=("gloo", "dtrain"),
                        help="dtrain: dtrain's torch.distributed backend (import dtrain_torch), impl=dtrain_torch")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    if args.micro:
        return micro(args)

    distributed = "RANK" in os.environ
    if distributed:
        if args.backend == "dtrain":
            import dtrain_torch  # noqa: F401  (registers the backend)
        dist.init_process_group(backend=args.backend, init_method="env://")
    world = dist.get_world_size() if distributed else 1
    rank = dist.get_rank() if distributed else 0
    if args.global_batch % world:
        raise SystemExit(f"torch_gpt.py: --global-batch {args.global_batch} is not divisible by {world} ranks")
    per_rank = args.global_batch // world
    t = args.context
    train_bytes, val_bytes = fortunes_split(args.data)
    train = torch.frombuffer(bytearray(train_bytes), dtype=torch.uint8)
    val = torch.frombuffer(bytearray(val_bytes), dtype=torch.uint8)
    windows = len(train) - t

    torch.manual_seed(args.seed)
    model = Gpt(256, t, args.layers, args.heads, args.width)
    if args.init:
        state = load_safetensors(args.init)
        model.load_state_dict({k[len("model."):] if k.startswith("model.") else k: v for k, v in state.items()})
    ddp = nn.parallel.DistributedDataParallel(model) if distributed else model
    opt = torch.optim.AdamW(decay_groups(model, args.weight_decay), lr=args.lr, betas=(0.9, 0.95))
    start = None
    for step in range(args.steps):
        if step == args.bench_warmup:
            if distributed:
                dist.barrier()
            start = time.perf_counter()
        x, y = gather(train, window_starts(args.seed, step, args.global_batch, world, rank, per_rank, windows), t)
        for group in opt.param_groups:
            group["lr"] = lr_at(step, args.lr, args.warmup, args.steps, args.min_lr)
        opt.zero_grad(set_to_none=True)
        with torch.cpu.amp.autocast(dtype=torch.bfloat16, enabled=args.precision == "bf16"):
            loss = lm_loss(ddp(x), y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), args.grad_clip if args.grad_clip > 0 else 1e30)
        opt.step()
    seconds = time.perf_counter() - start
    val_loss = validation_loss(model, val, t, args.eval_windows, world, rank)
    rss = torch.tensor([peak_rss_mib()])
    if distributed:
        dist.all_reduce(rss, op=dist.ReduceOp.MAX)
    if rank == 0:
        timed = args.steps - args.bench_warmup
        impl = "dtrain_torch" if args.backend == "dtrain" else "torch"
        print(f"RESULT gpt impl={impl} world={world} global_batch={args.global_batch} "
              f"model=L{args.layers}-H{args.heads}-C{args.width}-T{t} steps={args.steps} "
              f"step_ms={1e3 * seconds / timed:.3f} tokens_per_s={timed * args.global_batch * t / seconds:.1f} "
              f"peak_rss_mb={rss.item():.1f} val_loss_nats={val_loss:.5f} "
              f"precision={'bf16-autocast' if args.precision == 'bf16' else 'fp32'}", flush=True)
    if distributed:
        dist.barrier()
        dist.destroy_process_group()


if __name__ == "__main__":
    main()

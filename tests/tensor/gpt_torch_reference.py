#!/usr/bin/env python3
"""The PyTorch side of tensor_gpt_torch_test: loads a GPT's weights and a batch of tokens from
a safetensors file that the C++ test wrote, runs bench/peers/torch_gpt.py's model (PyTorch
1.13, the same architecture and names) forward and backward, and writes the logits, the loss
and every parameter's gradient ("grad.<name>") to another safetensors file.

  gpt_torch_reference.py IN OUT --layers L --heads H --width C --context T

Exits non-zero with the reason when torch cannot be imported: the test then fails (it does
not skip), because this comparison is how the model is known to be right.
"""
import argparse
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "bench", "peers"))

try:
    import torch
    import torch_gpt
except ImportError as e:
    sys.exit(f"gpt_torch_reference.py: cannot import torch ({e}); scripts/setup.sh installs python3-torch")


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("inp")
    parser.add_argument("out")
    parser.add_argument("--layers", type=int, required=True)
    parser.add_argument("--heads", type=int, required=True)
    parser.add_argument("--width", type=int, required=True)
    parser.add_argument("--context", type=int, required=True)
    args = parser.parse_args()
    torch.set_num_threads(1)
    state = torch_gpt.load_safetensors(args.inp)
    tokens = state.pop("tokens")
    model = torch_gpt.Gpt(256, args.context, args.layers, args.heads, args.width)
    model.load_state_dict(state)
    logits = model(tokens[:, :-1].contiguous())
    loss = torch_gpt.lm_loss(logits, tokens[:, 1:].contiguous())
    loss.backward()
    out = {"logits": logits.detach(), "loss": loss.detach().reshape([])}
    for name, p in model.named_parameters():
        out["grad." + name] = p.grad
    torch_gpt.save_safetensors(args.out, out)
    print(f"torch {torch.__version__}: loss {loss.item():.6f}")


if __name__ == "__main__":
    main()

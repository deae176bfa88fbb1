"""Run by scripts/torch-latest.sh under the newest torch: register and capture, each checked
against the local result, with every warning recorded; exits 1 if torch.jit is called or a
deprecation warning shows."""
import os
import subprocess
import sys
import warnings

import torch
import transformers

import djinn

DEPRECATIONS = (DeprecationWarning, FutureWarning, PendingDeprecationWarning)
REMOTE = "remote_accelerator:0"


def refuse(*args, **kwargs):
    raise AssertionError("torch.jit was called")


def hf_gpt2():
    cfg = transformers.GPT2Config(vocab_size=97, n_positions=64, n_embd=32, n_layer=2, n_head=4,
                                  bos_token_id=0, eos_token_id=0, pad_token_id=0)
    return transformers.GPT2LMHeadModel(cfg).eval()


def checks(client) -> None:
    from gpt import GPT, GPTConfig

    torch.manual_seed(0)
    mlp = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4)).eval()
    x = torch.randn(3, 16)
    with torch.no_grad():
        assert torch.equal(djinn.register(mlp, x)(x), mlp(x))
        assert torch.equal(djinn.register(mlp, x, split=True)(x), mlp(x))
        gpt = GPT(GPTConfig.tiny()).eval()
        idx = torch.randint(0, 97, (2, 8))
        assert torch.equal(djinn.register(gpt, idx, blocks=gpt.blocks())(idx), gpt(idx))
    print(f"registered as graphs: whole, split=True, blocks=[...]; torch {torch.__version__}")

    lm = hf_gpt2()
    prompt = torch.randint(1, 97, (1, 5))
    with torch.no_grad():
        want = lm.generate(prompt, max_new_tokens=6, do_sample=False)
    rm = djinn.register(lm, {"input_ids": prompt}, dynamic={"input_ids": {1: ("seq", 2, 32)}}, cache_len=32)
    with rm.session() as s:
        logits = s.step(input_ids=prompt)
        tokens = [logits[:, -1].argmax(-1, keepdim=True)]
        for _ in range(5):
            tokens.append(s.step(input_ids=tokens[-1])[:, -1].argmax(-1, keepdim=True))
    assert torch.cat(tokens, 1).tolist() == want[:, 5:].tolist()
    print("a cache_len= session generated the local tokens")

    with torch.no_grad():
        want_logits = lm(prompt).logits
        lm.to(REMOTE)
        torch.testing.assert_close(lm(prompt.to(REMOTE)).logits.cpu(), want_logits)
        got = lm.generate(prompt.to(REMOTE), max_new_tokens=6, do_sample=False).cpu()
    assert got.tolist() == want.tolist()
    print(f"captured forward and generate equal local ({client.stats()['capture']['graphs_built']} graphs built)")


def main() -> int:
    node = subprocess.Popen([os.environ["DJINN_BIN"], "node", "--listen", "127.0.0.1:0", "--log", "warn"],
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
    try:
        client = djinn.init(node.stdout.readline().decode().split()[-1])
        for name in ("script", "trace", "save", "load"):
            setattr(torch.jit, name, refuse)
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            checks(client)
    finally:
        node.terminate()
        node.wait(10)
    deprecations = [w for w in seen if issubclass(w.category, DEPRECATIONS)]
    for w in seen:
        print(f"warning: {w.category.__name__} at {w.filename}:{w.lineno}: {w.message}")
    print(f"{len(seen)} warnings, {len(deprecations)} of them deprecations")
    return 1 if deprecations else 0


if __name__ == "__main__":
    sys.exit(main())

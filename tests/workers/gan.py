"""The DCGAN-shaped loop through mpt on this rank's slice of each global batch, then a save,
spoilt weights and a load; writes this rank's parameters and what it saw.

usage: gan.py OUT_DIR STEPS GLOBAL_BATCH
"""

import sys
from pathlib import Path

import torch
from gan_common import batches, iteration, make_pair

import mpt

out, steps, size = Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
rt = mpt.Runtime()
generator, discriminator, opt_g, opt_d = make_pair()
generator, opt_g = rt.setup(generator, opt_g, name="G")
discriminator, opt_d = rt.setup(discriminator, opt_d, name="D")
share = size // rt.world_size
stepped = []
for real, noise in batches(steps, size):
    rows = slice(rt.rank * share, (rt.rank + 1) * share)
    iteration(generator, discriminator, opt_g, opt_d, real[rows].to(rt.device),
              noise[rows].to(rt.device), rt.backward, lambda opt: stepped.append(rt.step(opt)))


def params() -> dict[str, list[torch.Tensor]]:
    state = {}
    for name, model in (("G", generator), ("D", discriminator)):
        # DeepSpeed ZeRO-3 keeps only shards in the module: the checkpoint's full weights
        full = rt.backend.model_state_dict(model)
        state[name] = [full[n].detach().cpu().clone()
                       for n, _ in rt.backend.unwrap(model).named_parameters()]
    return state


trained = params()
where = rt.save(out / "ckpt")
with torch.no_grad():
    for model in (generator, discriminator):
        for p in rt.backend.unwrap(model).parameters():
            p.add_(1.0)
rt.load(out / "ckpt")
torch.save({"trained": trained, "restored": params(), "stepped": stepped,
            "global_step": rt.global_step, "rank": rt.rank}, out / f"rank{rt.rank}.pt")
rt.close()

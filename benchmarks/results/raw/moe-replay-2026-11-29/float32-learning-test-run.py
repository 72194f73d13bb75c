"""The MoE learning test's spread in float32: python float32-learning-test-run.py SEED STEPS (one thread)."""
import sys
import time

from gcore import GRPO, HFEngine, TorchBackend, Trainer, TrainerConfig
from gcore.model import ModelConfig

seed = int(sys.argv[1]); steps = int(sys.argv[2])
t = time.time()
h = Trainer(trainer=TrainerConfig(max_steps=steps, seed=seed, default_root_dir=f"/tmp/moe-f32/{seed}", enable_progress_bar=False, save_final=False),
            model=ModelConfig(architecture="qwen3_moe", dtype="float32"), algorithm=GRPO(), engine=HFEngine(),
            backend=TorchBackend(routing_replay=True)).fit().history
r = [x["reward/mean"] for x in h]
print(seed, f"{time.time()-t:.0f}s", "first5 %.3f last5 %.3f" % (sum(r[:5])/5, sum(r[-5:])/5), [round(v,3) for v in r], flush=True)

"""The MoE learning test's spread in float32: python float32-learning-test-run.py SEED STEPS (one thread)."""

import sys
import time

from gcore import GRPO, HFEngine, TorchBackend, Trainer, TrainerConfig
from gcore.model import ModelConfig

seed, steps = int(sys.argv[1]), int(sys.argv[2])
start = time.time()
config = TrainerConfig(max_steps=steps, seed=seed, default_root_dir=f"/tmp/moe-f32/{seed}", enable_progress_bar=False,
                       save_final=False)
history = Trainer(trainer=config, model=ModelConfig(architecture="qwen3_moe", dtype="float32"), algorithm=GRPO(),
                  engine=HFEngine(), backend=TorchBackend(routing_replay=True)).fit().history
rewards = [m["reward/mean"] for m in history]
print(seed, f"{time.time() - start:.0f}s", f"first5 {sum(rewards[:5]) / 5:.3f} last5 {sum(rewards[-5:]) / 5:.3f}",
      [round(v, 3) for v in rewards], flush=True)

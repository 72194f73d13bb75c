"""The embedded multi-turn task: does the tiny model use what the environment reveals?

Trains the default tiny model on ``--data.task reveal --env reveal`` (the prompt hides a digit, the first
observation shows it ``--repeat`` times, the second turn is scored by ``target_char``) and, as a control,
the same with an observation that shows ``?`` instead of the digit. A policy that ignores the observation
can at best repeat one digit: 0.1 on average. Prints the mean reward per 10 steps for each seed and setting.

    python benchmarks/reveal_learning.py --seeds 0 1 2 --steps 40 --repeat 8
"""

import argparse
import tempfile

from gcore import Trainer, TrainerConfig
from gcore.data import DataConfig
from gcore.envs.reveal import RevealEnvironment
from gcore.types import SamplingParams


class Hidden(RevealEnvironment):
    """The control: the observation has the same length and shape, with ``?`` for the digit."""

    def step(self, state, response):
        turn = super().step(state, response)
        if not turn.done:
            turn.observation = "|" + "?" * self.repeat + "="
        return turn


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--repeat", type=int, default=8)
    parser.add_argument("--new-tokens", type=int, default=8)
    args = parser.parse_args()
    for seed in args.seeds:
        for name, env in (("revealed", RevealEnvironment(repeat=args.repeat)), ("hidden", Hidden(repeat=args.repeat))):
            result = Trainer(
                trainer=TrainerConfig(max_steps=args.steps, seed=seed, default_root_dir=tempfile.mkdtemp(),
                                      enable_progress_bar=False, save_final=False),
                data=DataConfig(task="reveal"), sampling=SamplingParams(max_new_tokens=args.new_tokens), env=env,
            ).fit()
            rewards = [m["reward/mean"] for m in result.history]
            blocks = [round(sum(rewards[i : i + 10]) / len(rewards[i : i + 10]), 3) for i in range(0, len(rewards), 10)]
            seconds = sum(m["time/step"] for m in result.history)
            print(f"seed {seed} {name:8s} mean reward per 10 steps {blocks}  ({seconds:.0f} s of steps)", flush=True)


if __name__ == "__main__":
    main()

"""``routed`` reward: each sample scored by the reward that its prompt's metadata names."""

from __future__ import annotations

from collections.abc import Sequence

from gcore.errors import ConfigError, RewardError
from gcore.rewards.base import Judge, RewardModel
from gcore.types import Prompt, Sample


class RoutedReward(RewardModel):
    """Scores each sample with ``routes[sample.prompt.metadata[key]]``, as verl routes by ``data_source``.

    The samples of one call are grouped by reward and each reward scores its group in one call (a
    generative judge batches its group); the scores come back in the samples' order. The route's score
    is also kept in ``sample.reward_info["route_<name>"]``. The prompts' metadata comes from the data
    (``--data.metadata_keys``; the ``mixed`` task sets ``reward``).

    Args:
        routes: the reward of each route name (from YAML: a mapping of names to
            ``class_path``/``init_args``).
        key: the prompt metadata field that names the route.
        default: the route of a prompt without ``key`` or with a value not in ``routes``;
            ``None``: such a prompt is an error.
    """

    def __init__(self, routes: dict[str, RewardModel], key: str = "reward", default: str | None = None) -> None:
        if not routes:
            raise ConfigError("--reward routed needs at least one route in --reward.routes")
        if default is not None and default not in routes:
            raise ConfigError(f"--reward.default {default!r} is not a route; valid routes: {', '.join(routes)}")
        self.routes, self.key, self.default = dict(routes), key, default

    def _rewards(self) -> list[RewardModel]:
        """Each distinct reward once (a reward may serve several routes)."""
        return list({id(reward): reward for reward in self.routes.values()}.values())

    def setup(self, device) -> None:  # noqa: ANN001
        for reward in self._rewards():
            reward.setup(device)

    def judges(self) -> list[Judge]:
        return [judge for reward in self._rewards() for judge in reward.judges()]

    def judged(self, prompt: Prompt) -> bool:
        try:
            return self.routes[self.route(prompt)].judged(prompt)
        except RewardError:  # no route: said in one line when its samples are scored
            return False

    def route(self, prompt: Prompt) -> str:
        """The route name of ``prompt``'s samples: its ``metadata[key]``, else ``default``."""
        metadata = prompt.metadata
        value = metadata.get(self.key)
        if isinstance(value, str) and value in self.routes:
            return value
        if self.default is not None:
            return self.default
        where = prompt.source or prompt.index
        if self.key not in metadata:
            raise RewardError(f"prompt {where}: no metadata {self.key!r} to route by (--reward.key); add the column "
                              "to --data.metadata_keys or set --reward.default")
        raise RewardError(f"prompt {where}: metadata {self.key!r} is {value!r}, not a route; valid routes: "
                          f"{', '.join(self.routes)} (or set --reward.default)")

    def score(self, samples: Sequence[Sample]) -> list[float]:
        self.last_errors, self.last_error = 0, None
        names = [self.route(sample.prompt) for sample in samples]
        groups: dict[int, list[int]] = {}  # id of a reward -> the positions of its samples
        for position, name in enumerate(names):
            groups.setdefault(id(self.routes[name]), []).append(position)
        scores = [0.0] * len(samples)
        for positions in groups.values():
            reward = self.routes[names[positions[0]]]
            group = [samples[p] for p in positions]
            values = self.score_part(reward, group)
            for p, value in zip(positions, values, strict=True):
                scores[p] = float(value)
                samples[p].reward_info[f"route_{names[p]}"] = scores[p]
        return scores

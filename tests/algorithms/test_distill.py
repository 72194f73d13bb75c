"""On-policy distillation (``--algorithm distill``): the teacher's per-token advantage, its gradient, a short run in
which the reverse KL to the teacher falls, and the one-line refusals."""

import math

import pytest
import torch
from lightning_fabric import Fabric
from transformers import AutoModelForCausalLM

from gcore import Distill, TorchBackend, Trainer
from gcore.algorithms.base import group_normalize
from gcore.algorithms.distill import check_teacher_vocabulary
from gcore.algorithms.teacher_engine import TeacherScoring
from gcore.backends.megatron import MegatronBackend
from gcore.data import DataConfig
from gcore.engines.base import Engine
from gcore.engines.hf import HFEngine
from gcore.errors import ConfigError
from gcore.model import ModelConfig, ModelSource, char_tokenizer, materialize, vl_tokenizer
from gcore.placement.dynamic import DynamicPlacement
from gcore.rewards.base import RuleReward
from gcore.testing import make_batch, set_up, tiny_fit
from gcore.trainer import TrainerConfig
from gcore.types import Prompt, Sample, SamplingParams, collate

TINY = ModelConfig(num_hidden_layers=1, hidden_size=32, intermediate_size=64)
PREFERRED = "7"  # the token the trained teacher prefers


def _checkpoint_dir(tmp_path):
    """A directory that passes Distill's own check (a config.json); the backend is what loads it."""
    (tmp_path / "config.json").write_text("{}")
    return str(tmp_path)


def _teacher(path, seed, steps=10):
    """The tiny model (seed ``seed``) taught for ``steps`` Adam steps to predict ``PREFERRED`` after any context: a
    teacher that differs from a student of the same seed by a preference the student can learn."""
    tokenizer = char_tokenizer()
    path = materialize(TINY, tokenizer, seed, str(path))
    model = AutoModelForCausalLM.from_pretrained(path)
    target = tokenizer.convert_tokens_to_ids(PREFERRED)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    generator = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        ids = torch.randint(4, len(tokenizer), (8, 12), generator=generator)
        logits = model(ids).logits.flatten(0, 1)
        loss = torch.nn.functional.cross_entropy(logits, torch.full((logits.shape[0],), target))
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    model.save_pretrained(path)
    return path


def test_advantage_is_the_negative_sampled_reverse_kl_by_hand(tmp_path):
    batch = make_batch([1.0, 0.0, 0.5], [0, 0, 1], length=4)
    student = torch.tensor([[0.0, -1.0, -2.0], [0.0, -0.5, -0.25], [0.0, -3.0, -1.0]])
    batch.engine_logprobs = student * batch.response_mask
    batch.teacher_logprobs = torch.tensor([[-9.0, -0.5, -4.0], [-9.0, -0.5, -1.25], [-9.0, -1.0, -2.0]])
    algorithm = Distill(teacher=_checkpoint_dir(tmp_path))
    expected = torch.tensor([[0.0, 0.5, -2.0], [0.0, 0.0, -1.0], [0.0, 2.0, -1.0]])  # -(student - teacher)
    assert torch.equal(algorithm.advantages(batch), expected)
    # the trainer's own log-probabilities before the update, when the algorithm computes them, are the student's
    batch.old_logprobs = batch.engine_logprobs + 0.25 * batch.response_mask
    assert torch.allclose(algorithm.advantages(batch), expected - 0.25 * batch.response_mask)
    batch.old_logprobs = None
    # added to the reward's group-normalised advantage with weights
    mixed = Distill(teacher=_checkpoint_dir(tmp_path), teacher_weight=0.5, reward_weight=2.0).advantages(batch)
    reward = group_normalize(batch.rewards, batch.group_ids, scale=True).unsqueeze(-1) * batch.response_mask
    assert torch.allclose(mixed, 0.5 * expected + 2.0 * reward)
    assert reward.abs().sum() > 0  # the reward part is not zero, so the sum above tests it


def _backend(student, teacher, lr=1e-2):
    algorithm = Distill(teacher=teacher)
    backend = TorchBackend(lr=lr)
    backend.setup(Fabric(accelerator="cpu", devices=1), ModelSource(student), algorithm, embedded=True)
    return backend, set_up(algorithm, 6)


def _batch(backend, seed=0, temperature=1.0):
    """Eight of the student's own samples (drawn from its distribution), with its log-probabilities as the engine's."""
    return _batch_and_samples(backend, seed, temperature)[0]


def _batch_and_samples(backend, seed=0, temperature=1.0):
    tokenizer, generator = char_tokenizer(), torch.Generator().manual_seed(seed)
    model = backend.hf_model
    samples = []
    for row in range(8):
        ids = torch.randint(4, len(tokenizer), (3,), generator=generator).tolist()
        prompt = list(ids)
        with torch.no_grad():
            for _ in range(5):
                probs = model(torch.tensor([ids])).logits[0, -1].softmax(-1)
                ids.append(int(torch.multinomial(probs, 1, generator=generator)))
        response = ids[3:]
        samples.append(Sample(Prompt(row, "p", prompt), row, response, [0.0] * len(response), "r", True, 0.0))
    batch = collate(samples, tokenizer.pad_token_id, temperature)
    batch.engine_logprobs = backend.compute_logprobs(batch, "policy") * batch.response_mask
    batch.teacher_logprobs = backend.compute_logprobs(batch, "teacher")
    return batch, samples


def test_a_teacher_equal_to_the_student_gives_no_signal(tmp_path):
    student = materialize(TINY, char_tokenizer(), 0, str(tmp_path / "student"))
    teacher = materialize(TINY, char_tokenizer(), 0, str(tmp_path / "teacher"))  # the same weights
    backend, algorithm = _backend(student, teacher)
    batch = _batch(backend)
    batch.advantages = algorithm.advantages(batch)
    assert batch.response_mask.sum() > 0 and torch.equal(batch.advantages, torch.zeros_like(batch.advantages))
    metrics = backend.train(batch, algorithm)
    assert metrics["distill/reverse_kl"] == 0.0 and metrics["grad_norm"] == 0.0


def test_the_update_raises_the_probability_of_the_teachers_preferred_token(tmp_path):
    student = materialize(TINY, char_tokenizer(), 0, str(tmp_path / "student"))
    backend, algorithm = _backend(student, _teacher(tmp_path / "teacher", seed=0, steps=14))
    batch = _batch(backend)
    batch.advantages = algorithm.advantages(batch)
    target = char_tokenizer().convert_tokens_to_ids(PREFERRED)
    mask = batch.response_mask > 0

    def preferred_probability():
        with torch.no_grad():
            return backend.hf_model(batch.input_ids).logits[:, :-1].softmax(-1)[..., target][mask].mean()

    def exact_reverse_kl():
        with torch.no_grad():
            student_lp = backend.hf_model(batch.input_ids).logits[:, :-1].log_softmax(-1)
            teacher_lp = backend.teacher(batch.input_ids).logits[:, :-1].log_softmax(-1)
            return (student_lp.exp() * (student_lp - teacher_lp)).sum(-1)[mask].mean()

    before, kl_before = preferred_probability(), exact_reverse_kl()
    metrics = backend.train(batch, algorithm)
    assert metrics["distill/reverse_kl"] > 0.5  # the teacher differs: the sampled estimate of KL(student||teacher)
    after, kl_after = preferred_probability(), exact_reverse_kl()
    assert after > before * 1.01, (before, after)  # measured: +3.1% in one step at lr 1e-2 (0.00967 -> 0.00997)
    assert kl_after < kl_before, (kl_before, kl_after)


def _fit(teacher, seed, steps):
    import tempfile

    return Trainer(
        trainer=TrainerConfig(max_steps=steps, default_root_dir=tempfile.mkdtemp(prefix="gcore-test-"),
                              enable_progress_bar=False, seed=seed),
        model=TINY, data=DataConfig(prompts_per_step=4), sampling=SamplingParams(n=4, max_new_tokens=6),
        algorithm=Distill(teacher=teacher), backend=TorchBackend(lr=1e-2),
    ).fit()


def test_the_reverse_kl_to_the_teacher_falls_over_a_few_steps_on_seeds(tmp_path):
    """The student (the embedded tiny model, seed s) and a teacher of the same seed that prefers one token: over 5
    steps of on-policy distillation the logged reverse KL falls on every seed (measured: first step 0.38-0.45, mean
    of the last two 0.26-0.33; over the seeds 0.68 of the first)."""
    firsts, lasts = [], []
    for seed in range(3):
        history = _fit(_teacher(tmp_path / f"teacher{seed}", seed), seed, steps=5).history
        kl = [m["distill/reverse_kl"] for m in history]
        assert all(math.isfinite(k) for k in kl) and kl[0] > 0.2, kl
        firsts.append(kl[0])
        lasts.append(sum(kl[-2:]) / 2)
        assert lasts[-1] < firsts[-1], (seed, kl)
    assert sum(lasts) < 0.85 * sum(firsts), (firsts, lasts)


def test_refusals_are_one_line(tmp_path):
    with pytest.raises(ConfigError, match=r"^--algorithm.teacher is required by --algorithm distill: a local HF"):
        Distill()
    with pytest.raises(ConfigError, match=rf"^--algorithm.teacher {tmp_path / 'nowhere'}: no HF checkpoint there"):
        Distill(teacher=str(tmp_path / "nowhere"))
    with pytest.raises(ConfigError, match=r"^--algorithm.teacher_weight must be > 0, got 0"):
        Distill(teacher=_checkpoint_dir(tmp_path), teacher_weight=0.0)
    with pytest.raises(ConfigError, match=r"^--algorithm.reward_weight must be >= 0, got -1"):
        Distill(teacher=_checkpoint_dir(tmp_path), reward_weight=-1.0)
    with pytest.raises(ConfigError, match=r"^--algorithm Distill needs a teacher model \(--algorithm.teacher\), "
                                          r"which backend MegatronBackend does not load \(use --backend torch\)$"):
        Trainer(algorithm=Distill(teacher=_checkpoint_dir(tmp_path)), backend=MegatronBackend())


def test_a_teacher_with_another_vocabulary_is_refused(tmp_path):
    student = materialize(TINY, char_tokenizer(), 0, str(tmp_path / "student"))
    teacher = materialize(TINY, char_tokenizer(), 1, str(tmp_path / "teacher"))
    check_teacher_vocabulary(ModelSource(student), ModelSource(teacher))  # the same tokenizer: accepted
    vl_tokenizer().save_pretrained(teacher)  # another vocabulary (104 tokens, not 100)
    message = (rf"^--algorithm.teacher {teacher}: its tokenizer's vocabulary \(104 tokens\) is not the student's "
               r"\(100 tokens, \d+ differ\); on-policy distillation needs a teacher with the student's tokenizer$")
    with pytest.raises(ConfigError, match=message):
        _backend(student, teacher)


class _Sevens(RuleReward):
    """The count of the teacher-preferred token in a reply."""

    def score_one(self, sample):
        return float(sample.response_ids.count(char_tokenizer().convert_tokens_to_ids(PREFERRED)) + 1)


def test_the_teacher_engine_gives_the_trainers_teacher_logprobs_and_the_same_update(tmp_path):
    """``--algorithm.teacher_engine hf``: the teacher's log-probabilities scored by an engine (``TeacherScoring``, as
    a placement runs it in the controller's process) travel with the samples into the batch and equal the trainer's
    teacher's, at the sampling temperature; the update from them equals the update of the trainer's teacher."""
    student = materialize(TINY, char_tokenizer(), 0, str(tmp_path / "student"))
    teacher = _teacher(tmp_path / "teacher", seed=0)
    in_backend, algorithm = _backend(student, teacher)
    batch, samples = _batch_and_samples(in_backend, temperature=0.7)
    on_engine = Distill(teacher=teacher, teacher_engine=HFEngine())
    assert on_engine.teacher_path is None  # the trainer loads no teacher
    engine_backend = TorchBackend(lr=1e-2)
    engine_backend.setup(Fabric(accelerator="cpu", devices=1), ModelSource(student), on_engine, embedded=True)
    set_up(on_engine, 6)
    assert engine_backend.teacher is None
    scoring = on_engine.teacher_scoring(_Sevens(), temperature=0.7)
    assert isinstance(scoring, TeacherScoring) and [j.source.path for j in scoring.judges()] == [teacher]
    scoring.setup(None)
    rewards = scoring.score(samples)
    assert rewards == _Sevens().score(samples) and sum(rewards) > 0  # the run's reward, unchanged
    assert scoring.last_teacher_tokens == int(batch.response_mask.sum()) == 40
    assert all(s.teacher_logprobs is not None and len(s.teacher_logprobs) == len(s.response_ids) for s in samples)
    scored = collate(samples, char_tokenizer().pad_token_id, 0.7)
    assert scored.teacher_logprobs is not None
    mask = batch.response_mask > 0
    assert torch.allclose(scored.teacher_logprobs[mask], batch.teacher_logprobs[mask], atol=1e-5)
    assert not torch.allclose(batch.teacher_logprobs[mask], batch.engine_logprobs[mask], atol=1e-2)  # a real signal
    scored.engine_logprobs = batch.engine_logprobs
    batch.advantages, scored.advantages = algorithm.advantages(batch), on_engine.advantages(scored)
    assert torch.allclose(batch.advantages, scored.advantages, atol=1e-5)
    metrics = in_backend.train(batch, algorithm)
    engine_metrics = engine_backend.train(scored, on_engine)
    assert metrics["grad_norm"] > 0
    assert math.isclose(metrics["distill/reverse_kl"], engine_metrics["distill/reverse_kl"], abs_tol=1e-5)
    assert math.isclose(metrics["grad_norm"], engine_metrics["grad_norm"], rel_tol=1e-4)
    for (name, mine), (_, theirs) in zip(in_backend.named_weights(), engine_backend.named_weights(), strict=True):
        assert torch.allclose(mine, theirs, atol=1e-6), name


@pytest.mark.integration
def test_the_teacher_engine_on_an_engine_worker_under_dynamic_placement(tmp_path):
    """``--placement dynamic``: the teacher's engine is placed as a judge's is, on the judge partition (one of two
    workers: ``placement/judge_devices``), and scores every sample there (one step: the workers' start is most of
    its cost)."""
    teacher = _teacher(tmp_path / "teacher", seed=0)
    placement = DynamicPlacement(workers=2)
    result = tiny_fit(steps=1, algorithm=Distill(teacher=teacher, teacher_engine=HFEngine()), placement=placement)
    history = result.history
    assert [m["placement/judge_devices"] for m in history] == [1.0]
    assert all(m["distill/reverse_kl"] > 0.2 and math.isfinite(m["distill/reverse_kl"]) for m in history), history
    assert placement.pool is not None and placement.pool.busy.get("judge", 0.0) > 0  # served on the judge worker


class _GeneratesOnly(Engine):
    """An engine that generates but does not score given tokens (no ``token_logprobs``)."""

    def setup(self, source, device):
        pass

    def generate(self, prompts, params, visual=None):
        return []

    def update_weights(self, weights):
        return 0


def test_teacher_engine_refusals_are_one_line(tmp_path):
    from gcore.cli import resolve_argv

    assert resolve_argv(["--algorithm.teacher_engine", "hf"]) == ["--algorithm.teacher_engine",
                                                                  "gcore.engines.hf.HFEngine"]
    with pytest.raises(ConfigError, match=r"^--algorithm.teacher_engine _GeneratesOnly: this engine does not score "
                                          r"given tokens \(Engine.token_logprobs\), which the teacher needs; valid "
                                          r"choices: hf, or no teacher_engine \(the trainer's teacher\)$"):
        Distill(teacher=_checkpoint_dir(tmp_path), teacher_engine=_GeneratesOnly())
    # a teacher with another vocabulary: refused before any engine starts, as the trainer's teacher is
    teacher = materialize(TINY, char_tokenizer(), 1, str(tmp_path / "teacher"))
    vl_tokenizer().save_pretrained(teacher)
    message = (rf"^--algorithm.teacher {teacher}: its tokenizer's vocabulary \(104 tokens\) is not the student's "
               r"\(100 tokens, \d+ differ\); on-policy distillation needs a teacher with the student's tokenizer$")
    with pytest.raises(ConfigError, match=message):
        tiny_fit(steps=1, algorithm=Distill(teacher=teacher, teacher_engine=HFEngine()))

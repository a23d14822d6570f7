"""reward: the scorers, the custom functions' sandbox, reward models."""

from __future__ import annotations

import re
from typing import Any, Literal

from pydantic import (
    Field,
    ValidationInfo,
    field_validator,
    model_validator,
)

from rlfabric.core.config.base import Section


class CustomSandboxConfig(Section):
    uid: int = Field(64000, ge=1)
    """First uid of the sandbox's range (root only): each reward worker runs its user code as a uid of uid .. uid + uid_count - 1 of its own, one no other worker, call or process uses, so its signals (kill(-1) included) and RLIMIT_NPROC reach its own processes only. Keep the range apart from env.python.sandbox's and below 65536 (user namespaces map no more)."""
    uid_count: int = Field(64, ge=1)
    """How many uids the range holds: at least the workers (or concurrent python calls) of every service of this machine using it; a uid some process already runs as is skipped."""
    gid: int = Field(65534, ge=1)
    """Group of user code when the service runs as root (65534 = nogroup); no supplementary groups."""
    allow_network: bool = False
    """Let user code use this host's network (e.g. to call an API); it then reaches every service here too. false = a network namespace of its own: no network at all."""
    require_network_isolation: bool = False
    """Fail start-up where the kernel refuses user code a network namespace (not root and no unprivileged user namespaces); false = log a warning and run it with this host's network."""
    env: dict[str, str] = {}
    """Environment variables of user code besides PATH, HOME and TMPDIR; the service's own environment is not passed on."""
    env_passthrough: list[str] = []
    """Names of the service's environment variables passed on to user code (e.g. an API key's)."""
    max_processes: int = Field(128, ge=8)
    """RLIMIT_NPROC of user code (root only): most processes and threads of one worker's (or python call's) uid."""
    max_file_mb: int = Field(64, ge=1)
    """RLIMIT_FSIZE of user code: largest file it may write (MiB); writing more fails with EFBIG."""
    max_open_files: int = Field(256, ge=16)
    """RLIMIT_NOFILE of user code: most file descriptors one of its processes may hold."""
    cpu_limit_s: int = Field(60, ge=1)
    """RLIMIT_CPU of user code: CPU seconds (all threads together) one item may use, renewed before each item; a hard limit only where the worker has CAP_SYS_RESOURCE."""
    private_tmp: bool = True
    """Give user code empty /tmp, /var/tmp and /dev/shm of its own (tmpfs in a mount namespace, each at most the memory limit), emptied after each item (with its working directory, TMPDIR) and gone when its worker ends: no call sees what an earlier one wrote there. They hide the host's, so keep files the function reads elsewhere (or open them at import). false, or where no mount namespace can be made: the host's, and what the sandbox uid left there is deleted after each item (root only; not root, only the working directory is emptied)."""
    memory_cgroup: bool = True
    """Bound the memory of all the sandbox's processes together with a cgroup v1 memory controller where one can be made (root, a writable cgroup file system); false, or where none can be made: by counting its processes' memory (every 0.2 s while user code runs) and killing them past the limit."""


class PythonSandboxConfig(CustomSandboxConfig):
    """The python tool's sandbox: the reward sandbox's settings, with a uid range of its own and a private /tmp."""

    uid: int = Field(64064, ge=1)
    """First uid of the python tool's range (root only): each call runs as a uid of uid .. uid + uid_count - 1 of its own, one no other call, reward worker or process uses, so its signals (kill(-1) included) and RLIMIT_NPROC reach its own processes only. Keep the range apart from reward.custom_sandbox's and below 65536."""
    uid_count: int = Field(256, ge=1)
    """How many uids the range holds: at least the python calls that may run at once (env.threads) on this machine; a call waits for a free one up to half its timeout_s."""
    private_tmp: bool = True
    """Give the code empty /tmp, /var/tmp and /dev/shm of its own for each call (tmpfs in a mount namespace, each at most env.python.memory_limit_mb), so nothing written there is kept between calls; false, or where no mount namespace can be made: the host's, and what the call's uid left there is deleted after the call (root only)."""


DEFAULT_JUDGE_TEMPLATE = (
    "Rate how well the response answers the question, from 0 (wrong) to 10 (correct and clear).\n\n"
    "Question: {prompt}\n\nResponse: {response}\n\nReply with one line: Score: N"
)
JUDGE_FIELDS = ("prompt", "response", "ground_truth")


class JudgeConfig(Section):
    """A generative judge (LLM-as-judge): rollout services serving the judge model read each item through a prompt
    template and write a verdict; its parsed score is the item's reward. The judge pool is its own: it never
    receives weight syncs."""

    addresses: list[str] = []
    """gRPC addresses ("host:port") of the rollout services that serve the judge model (started with their own
    model.path); empty = no judge, unless judge.model_path is set: the launchers and the chart then start that
    pool and write its addresses here. They must not be the policy's rollout replicas (cluster.rollout)."""
    data_sources: list[str] = []
    """data_source values the judge scores; empty = every item (the custom function's and the reward model's
    sources excepted). Other items go to the rule registered for their data_source."""
    prompt_template: str = DEFAULT_JUDGE_TEMPLATE
    """The judge's user message: {response} (required), {prompt} and {ground_truth} are replaced by the item's;
    any other braces stay as written. It is rendered with the judge model's chat template by its rollout service."""
    system_prompt: str = ""
    """A system message before the template's user message; empty = none (the chat template's default)."""
    parse: Literal["regex", "json"] = "regex"
    """How the score is read from the verdict: regex = the first match of `regex`, its one group a number;
    json = the number at `json_field` of the first JSON object in the verdict."""
    regex: str = r"Score:\s*(-?\d+(?:\.\d+)?)"
    """With parse regex: a regular expression with exactly one group, the score."""
    json_field: str = "score"
    """With parse json: the key of the score in the verdict's JSON object."""
    min_score: float = 0.0
    """Lowest score the judge may give."""
    max_score: float = 10.0
    """Highest score the judge may give."""
    out_of_range: Literal["clamp", "fail"] = "clamp"
    """A parsed score outside [min_score, max_score]: clamp = moved to the nearest bound; fail = the item fails
    (status error), as an unparseable verdict does."""
    batch_size: int = Field(8, ge=1)
    """Most items per Generate request to the judge, gathered from concurrent Score calls."""
    max_concurrency: int = Field(4, ge=1)
    """Most Generate requests in flight to the judge pool at once; more items wait in the queue."""
    timeout_s: float = Field(60.0, gt=0)
    """Deadline of one Generate request; its items fail with status timeout past it (never a hang)."""
    max_tokens: int = Field(32, ge=1)
    """Most tokens of a verdict."""
    temperature: float = Field(0.0, ge=0)
    """Sampling temperature of the judge; 0 = greedy (the default: the same item gets the same verdict)."""
    seed: int | None = 0
    """Sampling seed of the judge's requests when temperature > 0; null = random."""

    @field_validator("prompt_template")
    @classmethod
    def _template_reads_the_response(cls, template: str) -> str:
        if "{response}" not in template:
            raise ValueError("reward.judge.prompt_template has no {response}: the judge would never see the response")
        return template

    @model_validator(mode="after")
    def _parse_rule_and_range(self) -> JudgeConfig:
        if self.parse == "regex":
            try:
                groups = re.compile(self.regex).groups
            except re.error as error:
                raise ValueError(f"reward.judge.regex {self.regex!r} is not a regular expression: {error}") from None
            if groups != 1:
                raise ValueError(f"reward.judge.regex {self.regex!r} has {groups} groups; it needs exactly one, "
                                 "the score")
        elif not self.json_field:
            raise ValueError("reward.judge.json_field is empty: parse json needs the key of the score")
        if not self.min_score < self.max_score:
            raise ValueError(f"reward.judge.min_score {self.min_score:g} must be below max_score {self.max_score:g}")
        return self


class RewardConfig(Section):
    """The reward service: rule scorers, sandboxed custom functions and reward models."""

    num_workers: int = Field(1, ge=1)
    """Worker processes for custom reward functions."""
    pool: str = ""
    """Key of resource_pools this role runs on; empty = no pool (every device of the machine, as before)."""
    custom_path: str = ""
    """Python file with a custom reward function (VeRL: custom_reward_function.path); it scores the items of
    custom_sources, or every item not routed to the reward model when custom_sources is empty."""
    custom_sources: list[str] = []
    """data_source values the custom function scores; empty = every item (the reward model's sources excepted)."""
    custom_name: str = "compute_score"
    """Function in custom_path, called as custom_signature says."""
    custom_signature: Literal["verl", "trl"] = "verl"
    """How the custom function is called. verl: fn(data_source, solution_str, ground_truth, extra_info, **custom_kwargs)
    -> float or {score, other metrics} (VeRL's compute_score); trl: fn(prompts, completions, **columns, **custom_kwargs)
    -> list[float] (TRL's reward functions; columns: ground_truth, data_source and each extra_info key, as lists)."""
    custom_kwargs: dict[str, Any] = {}
    """Keyword arguments of every custom function call (VeRL: custom_reward_function.reward_kwargs)."""
    timeout_s: float = Field(10.0, gt=0)
    """A custom function call running longer is killed; its item gets status TIMEOUT and score 0."""
    memory_limit_mb: int = Field(4096, ge=0)
    """Memory cap of each custom-function worker (MiB; 0 = none): each of its processes' address space (RLIMIT_AS: a hog gets MemoryError) and all of them together (see custom_sandbox.memory_cgroup: past it the item fails, the worker is replaced)."""
    custom_sandbox: CustomSandboxConfig = CustomSandboxConfig()
    """How the custom function is confined: network, uid, environment and resource limits."""
    compute_score_kwargs: dict[str, Any] = {}
    """Keyword arguments of every built-in scorer call, e.g. {method: flexible} for GSM8K."""
    scorer_modules: list[str] = []
    """Modules the reward service imports at start, so their register_scorer calls add data sources."""
    max_stuck_scorer_threads: int = Field(4, ge=1)
    """In-process scorers (built-in, scorer_modules) past timeout_s give their item TIMEOUT, but their thread
    cannot be killed; while this many are still running, every in-process item gets TIMEOUT at once."""
    default_score_for_unknown: float | None = None
    """Score of an item whose data_source has no scorer; null = such a request is INVALID_ARGUMENT."""
    max_items_per_request: int = Field(100_000, ge=1)
    """Most items one Score request may carry; more is RESOURCE_EXHAUSTED."""
    overlong_enable: bool = False
    """Add DAPO's overlong penalty to every score (VeRL: reward_model.overlong_buffer.enable)."""
    overlong_buffer_length: int = Field(256, gt=0)
    """The penalty ramps from 0 at Lmax - buffer_length tokens to -overlong_penalty_factor at Lmax."""
    overlong_penalty_factor: float = Field(1.0, ge=0)
    """Penalty (negated) of a response of Lmax tokens."""
    overlong_max_response_length: int = Field(0, ge=0)
    """Lmax of the overlong penalty in tokens; 0 = data.max_response_length."""
    tokenizer_path: str = ""
    """The policy's tokenizer, to decode response_token_ids sent without text; empty = text only (no torch)."""
    model_path: str = ""
    """Reward model directory (sequence classification, HF format); it scores the items of model_sources, or
    every item not routed to the custom function when model_sources is empty (VeRL's default)."""
    model_sources: list[str] = Field([], validate_default=True)
    """data_source values the reward model scores; empty = every item (the custom function's sources excepted).
    Items of other sources go to the custom function or the rule registered for their data_source."""
    model_tokenizer_path: str = ""
    """The reward model's tokenizer directory; empty = model_path."""
    model_batch_size: int = Field(16, ge=1)
    """Most sequences per reward-model forward pass, gathered from concurrent Score calls."""
    model_device: str = "cpu"
    """Torch device of the reward model, e.g. cuda:0."""
    model_dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    """Reward model weights dtype."""
    model_max_length: int = Field(0, ge=0)
    """Longest reward-model input in tokens (longer ones lose their start); 0 = no limit."""
    judge: JudgeConfig = JudgeConfig()
    """A generative judge: a pool of rollout services serving a judge model, for the items of judge.data_sources."""

    @field_validator("model_sources")
    @classmethod
    def _scorers_do_not_overlap(cls, model_sources: list[str], info: ValidationInfo) -> list[str]:
        """Each data_source goes to one scorer: the reward model and the custom function cannot both take
        every item, nor share a source; a source list needs its scorer."""
        custom_path, custom_sources = info.data.get("custom_path", ""), info.data.get("custom_sources", [])
        model_path = info.data.get("model_path", "")
        if custom_sources and not custom_path:
            raise ValueError("reward.custom_sources is set but reward.custom_path is empty")
        if model_sources and not model_path:
            raise ValueError("reward.model_sources is set but reward.model_path is empty")
        if custom_path and model_path:
            if not custom_sources and not model_sources:
                raise ValueError("reward.custom_path and reward.model_path would both score every item: "
                                 "list the data sources of one of them in reward.custom_sources or reward.model_sources")
            shared = sorted(set(custom_sources) & set(model_sources))
            if shared:
                raise ValueError(f"reward.custom_sources and reward.model_sources share {shared}: "
                                 "each data_source goes to one scorer")
        return model_sources

"""Tensor-parallel plans: which linear layers split how, from a Hugging Face `tp_plan`, DeepSpeed's
`partition_config` layer specs, or a preset; and `shard_model`, which applies a plan.

A plan is an ordered list of rules (first match wins): a regular expression over module names
and a `Style`. Sources, in DeepSpeed 0.19.8's order of precedence: `partition_config` and
`preset_model` (its configurable AutoTP), else the model's HF plan (`config.base_model_tp_plan`,
the class's and the instance's `_tp_plan`). Imports torch, zeroshard.config, errors, tensor_parallel/ and comm (types).
"""

from __future__ import annotations

import enum
import functools
import re
import weakref
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor, nn

from zeroshard.config.schema_tp import TensorParallelConfig
from zeroshard.errors import ConfigError, NotSupportedError
from zeroshard.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear

if TYPE_CHECKING:
    from zeroshard.comm import Comm


class Style(enum.Enum):
    COLUMN = "column"
    """Split the output features; the output stays sharded (feeds a ROW layer)."""
    COLUMN_GATHER = "column_gather"
    """Split the output features and gather the output (a head every rank reads whole)."""
    ROW = "row"
    """Split the input features (the input is a COLUMN layer's sharded output); all-reduce the output."""
    ROW_SCATTER = "row_scatter"
    """Split the input features of a whole input (each rank takes its slice first)."""
    SKIP = "skip"
    """Keep whole (replicated on every tensor-parallel rank)."""
    REPLICATED_GRAD_SUM = "replicated_grad_sum"
    """Keep whole, and sum the parameters' gradients over the tensor-parallel group: a replicated
    weight applied to split activations (Qwen3's q_norm / k_norm normalise each rank's heads), whose
    gradient each rank computes from its own heads only. HF's "replicated_with_grad_allreduce"."""


_HF_STYLES = {"colwise": Style.COLUMN, "colwise_rep": Style.COLUMN_GATHER, "colwise_gather_output": Style.COLUMN_GATHER,
              "rowwise": Style.ROW, "rowwise_rep": Style.ROW_SCATTER, "embedding_rowwise": Style.SKIP,
              "replicated_with_grad_allreduce": Style.REPLICATED_GRAD_SUM}
"""HF tp_plan styles -> zeroshard styles. An embedding stays whole, as DeepSpeed's AutoTP keeps it."""

_PRESET_SPECS: tuple[dict[str, Any], ...] = (
    {"patterns": [r".*\.self_attn\.o_proj\.weight$", r".*\.mlp\.down_proj\.weight$"], "partition_type": "row"},
    {"patterns": [r".*\.self_attn\.[qkv]_proj\.weight$", r".*\.mlp\.(up|gate)_proj\.weight$"],
     "partition_type": "column"},
)
"""The llama / qwen2 / mistral presets (separate q, k, v and gate, up projections)."""


@dataclass(frozen=True, slots=True)
class Rule:
    pattern: str
    """Regular expression matched (re.match) against `module_name` or `module_name.weight`."""
    style: Style
    model_types: tuple[str, ...] | None = None

    def matches(self, name: str, model_type: str | None) -> bool:
        if self.model_types is not None and (model_type or "").lower() not in self.model_types:
            return False
        return re.match(self.pattern, name + ".weight") is not None or re.match(self.pattern, name) is not None


@dataclass(frozen=True, slots=True)
class Plan:
    rules: tuple[Rule, ...]
    source: str
    """Where the rules came from (for messages): "HF tp_plan", "preset llama", "partition_config"."""
    strict: bool = False
    """Every Linear must match a rule (DeepSpeed's strict_mode), heads excepted."""
    head_patterns: tuple[str, ...] = ()

    def style_of(self, name: str, model_type: str | None) -> Style | None:
        for rule in self.rules:
            if rule.matches(name, model_type):
                return rule.style
        return None


@dataclass
class TensorParallelState:
    """What `shard_model` did to one model: the group and each split parameter's global layout."""

    comm: Comm
    plan: Plan
    split: dict[str, tuple[int, tuple[int, ...]]] = field(default_factory=dict)
    """Parameter name -> (split dimension, global shape) for every parameter sharded over tp."""
    sequence_parallel: bool = False
    grad_summed: set[str] = field(default_factory=set)
    """Names of whole parameters whose gradient is summed over tp (`Style.REPLICATED_GRAD_SUM`)."""
    replaced: dict[int, nn.Parameter] = field(default_factory=dict)
    """id of a parameter `shard_model` replaced -> its replacement (the local piece), so that
    `initialize(model_parameters=...)` given a list made before the split still names the model's
    parameters; initialize empties it (ids of dead tensors are reused)."""

    @property
    def size(self) -> int:
        return self.comm.world_size

    def full(self, name: str, local: Tensor) -> Tensor:
        """The whole tensor of parameter `name` from every rank's piece (collective over tp);
        `local` itself when the parameter is not split."""
        if name not in self.split:
            return local
        dim, _ = self.split[name]
        piece = local.detach().contiguous()
        out = torch.empty((self.size, *piece.shape), dtype=piece.dtype, device=piece.device)
        self.comm.all_gather(out, piece)
        return torch.cat(out.unbind(0), dim=dim)

    def piece(self, name: str, full: Tensor) -> Tensor:
        """This rank's piece of the whole tensor `full` of parameter `name` (`full` when not split)."""
        if name not in self.split:
            return full
        dim, _ = self.split[name]
        n = full.shape[dim] // self.size
        return full.narrow(dim, self.comm.rank * n, n)


_STATES: weakref.WeakKeyDictionary[nn.Module, TensorParallelState] = weakref.WeakKeyDictionary()


def tp_state_of(model: nn.Module) -> TensorParallelState | None:
    """The tensor-parallel state of a model `shard_model` sharded, else None."""
    return _STATES.get(model)


def _wildcard(pattern: str) -> str:
    body = re.escape(pattern).replace(r"\*", r"[^.]+")
    return rf"(.*\.)?{body}(\.weight)?$"


def hf_tp_plan(model: nn.Module) -> dict[str, str]:
    """The model's HF plan: `config.base_model_tp_plan` (relative to the base model), the class's
    and the instance's `_tp_plan`, merged (later wins)."""
    merged: dict[str, str] = {}
    config = getattr(model, "config", None)
    for plan in (getattr(config, "base_model_tp_plan", None), getattr(type(model), "_tp_plan", None),
                 getattr(model, "__dict__", {}).get("_tp_plan")):
        if isinstance(plan, Mapping):
            for pattern, style in plan.items():
                merged[pattern.removeprefix("model.")] = str(style)
    return merged


def plan_from_hf(tp_plan: Mapping[str, str]) -> Plan:
    """Rules from an HF plan; a style zeroshard does not build raises NotSupportedError naming it."""
    rules = []
    for pattern, style in tp_plan.items():
        key = style.lower()
        if key not in _HF_STYLES:
            raise NotSupportedError(
                f"not supported yet: the model's tp_plan style {style!r} (for {pattern!r}). zeroshard builds "
                f"{', '.join(sorted(_HF_STYLES))}; give tensor_parallel.partition_config layer specs instead.")
        rules.append(Rule(_wildcard(pattern), _HF_STYLES[key]))
    return Plan(tuple(rules), "the model's HF tp_plan")


def _spec_rules(specs: Sequence[Mapping[str, Any]]) -> list[Rule]:
    rules = []
    for spec in specs:
        kind = str(spec.get("partition_type", "column")).lower()
        style = {"row": Style.ROW, "skip": Style.SKIP}.get(kind, Style.COLUMN)
        if style is Style.SKIP and spec.get("grad_allreduce"):  # schema_tp allows it on skip specs only
            style = Style.REPLICATED_GRAD_SUM
        if style is Style.COLUMN and spec.get("gather_output"):
            style = Style.COLUMN_GATHER
        types = spec.get("model_types")
        for pattern in spec["patterns"]:
            rules.append(Rule(pattern, style, tuple(t.lower() for t in types) if types else None))
    return rules


def resolve_plan(model: nn.Module, config: TensorParallelConfig) -> Plan:
    """The plan for `model` under the `tensor_parallel` section (DeepSpeed's precedence).

    Raises:
        ConfigError: no source gives a plan.
        NotSupportedError: the HF plan holds a style that is not built.
    """
    part = config.partition_config
    preset = _spec_rules(_PRESET_SPECS) if config.preset_model else []
    if part.layer_specs:
        custom = _spec_rules(part.layer_specs)
        rules = custom + preset if (preset and part.use_default_specs) else custom
        return Plan(tuple(rules), "tensor_parallel.partition_config", part.strict_mode, part.lm_head_patterns)
    if preset:
        return Plan(tuple(preset), f"preset {config.preset_model!r}", part.strict_mode, part.lm_head_patterns)
    hf = hf_tp_plan(model)
    if hf:
        plan = plan_from_hf(hf)
        if config.vocab_parallel_lm_head is False:  # keep the head whole
            plan = Plan(tuple(r for r in plan.rules if r.style is not Style.COLUMN_GATHER), plan.source)
        return plan
    raise ConfigError(
        f"tensor_parallel: {type(model).__name__} has no Hugging Face tp_plan; set tensor_parallel.preset_model "
        "(\"llama\", \"qwen2\", \"mistral\") or give tensor_parallel.partition_config.layer_specs.")


def _check_heads(model: nn.Module, tp: int) -> None:
    config = getattr(model, "config", None)
    for key in ("num_attention_heads", "num_key_value_heads"):
        heads = getattr(config, key, None)
        if isinstance(heads, int) and heads % tp:
            raise ConfigError(f"tensor_parallel: the model's {key} = {heads} is not divisible by the tensor-parallel "
                              f"size {tp}; each rank must hold whole attention heads. Choose a size dividing {heads}.")


def _tied(model: nn.Module) -> set[int]:
    seen: dict[int, int] = {}
    for _, p in model.named_parameters(remove_duplicate=False):
        seen[id(p)] = seen.get(id(p), 0) + 1
    return {k for k, n in seen.items() if n > 1}


def _sum_over_tp(comm: Comm, grad: Tensor) -> Tensor:
    """A replicated parameter's gradient summed over the tensor-parallel ranks (a tensor hook: it
    runs before the gradient reaches `.grad` and ZeRO's reduction, once per use in backward)."""
    total = grad.contiguous().clone()
    comm.all_reduce(total)
    return total


def shard_model(model: nn.Module, plan: Plan, comm: Comm, *, sequence_parallel: bool = False,
                keep_whole: frozenset[int] = frozenset(), experts: frozenset[int] = frozenset()) -> TensorParallelState:
    """Replace the plan's linear layers of `model` by their tensor-parallel pieces, in place.

    Every tensor-parallel rank must hold the same whole model (initialize broadcasts it first).
    `sequence_parallel`: keep the residual stream cut along the sequence between the split layers
    (tensor_parallel/sequence.py; Hugging Face layouts). `keep_whole`: ids of parameters shared beyond
    `model` (a pipeline's tied weights, held by several stages), treated as tied. `experts`: ids of
    expert parameters (MoE layers): a layer holding one is never split, whatever rule matches it;
    experts are divided by expert parallelism and each tensor-parallel rank holds them whole
    (DeepSpeed's default, without `enable_expert_tensor_parallelism`).

    Raises:
        ConfigError: a split dimension the size does not divide, heads that do not divide, a
            strict plan leaving a Linear unmatched, or a plan that splits nothing.
        NotSupportedError: a rule matches a module other than nn.Linear, or a tied weight.
    """
    tp = comm.world_size
    _check_heads(model, tp)
    model_type = getattr(getattr(model, "config", None), "model_type", None)
    tied = _tied(model) | set(keep_whole)
    state = TensorParallelState(comm=comm, plan=plan)
    for name, module in list(model.named_modules()):
        if not name:
            continue
        style = plan.style_of(name, model_type)
        if isinstance(module, nn.Linear) and id(module.weight) in experts:
            continue
        if style is Style.REPLICATED_GRAD_SUM:
            for pname, p in module.named_parameters(recurse=False):
                if p.requires_grad and f"{name}.{pname}" not in state.grad_summed:
                    p.register_hook(functools.partial(_sum_over_tp, comm))
                    state.grad_summed.add(f"{name}.{pname}")
            continue
        if style is None or style is Style.SKIP:
            if plan.strict and style is None and isinstance(module, nn.Linear) \
                    and not any(h in name for h in plan.head_patterns):
                raise ConfigError(f"tensor_parallel.partition_config.strict_mode: Linear {name!r} matches no layer "
                                  "spec; add a spec (\"skip\" keeps it whole) or turn strict_mode off.")
            continue
        if not isinstance(module, nn.Linear):
            if any(isinstance(m, nn.Linear) for m in module.children()):
                continue  # a container matched by a loose pattern: its Linear children are matched themselves
            raise NotSupportedError(f"not supported yet: {plan.source} splits {name!r} ({type(module).__name__}) "
                                    f"as {style.value}; only nn.Linear layers are split.")
        if id(module.weight) in tied:
            if style is Style.COLUMN_GATHER:
                continue  # a head tied to the embedding stays whole, as DeepSpeed does without a vocab-parallel head
            raise NotSupportedError(f"not supported yet: {name!r} shares its weight with another module; a tied "
                                    "weight cannot be split.")
        dim = 0 if style in (Style.COLUMN, Style.COLUMN_GATHER) else 1
        size = module.weight.shape[dim]
        if size % tp:
            kind = "output" if dim == 0 else "input"
            raise ConfigError(f"tensor_parallel: {name}.weight has {size} {kind} features, "
                              f"not divisible by the tensor-parallel size {tp}; choose a size dividing {size}.")
        if dim == 0:
            gather = style is Style.COLUMN_GATHER
            new: nn.Module = ColumnParallelLinear(module, comm, gather_output=gather,
                                                  sequence_parallel=sequence_parallel and not gather)
        else:
            new = RowParallelLinear(module, comm, input_is_parallel=style is Style.ROW,
                                    sequence_parallel=sequence_parallel and style is Style.ROW)
        state.split[f"{name}.weight"] = (dim, tuple(module.weight.shape))
        if module.bias is not None and dim == 0:
            state.split[f"{name}.bias"] = (0, tuple(module.bias.shape))
        for attr in ("weight", "bias"):
            if getattr(module, attr) is not None:
                state.replaced[id(getattr(module, attr))] = getattr(new, attr)
        parent_name, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent_name) if parent_name else model, child, new)
    if not state.split:
        raise ConfigError(f"tensor_parallel: {plan.source} matches no linear layer of {type(model).__name__}; "
                          "check the patterns against model.named_modules().")
    if sequence_parallel:
        from zeroshard.tensor_parallel.sequence import enable_sequence_parallel

        enable_sequence_parallel(model, comm, set(state.split))
    state.sequence_parallel = sequence_parallel
    _STATES[model] = state
    return state

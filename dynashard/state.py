"""Everything dynashard keeps in the process outside the objects a user holds, each with its lifetime.

Three lists, each entry "where: created ...; gone ...":

- ``STATE``: values bound at a module's top level that change while the process runs (tables, counters,
  handles, a name rebound through ``global``);
- ``HOOKS``: what dynashard registers on torch or Python for the whole process (taggers, step hooks,
  module hooks, Dynamo skips, custom ops, an exit hook), patches of another module's attributes, and
  objects whose class it swaps;
- ``TABLES``: module-level dicts and sets filled as their module loads and never written after (op sets,
  dtype maps): listed so they can be told from state.

``tests/test_process_state.py`` reads the package's source with ``ast`` and fails on a top-level mutable
binding, a ``global`` rebinding, a process-wide registration or a patch that these lists do not name (and
on a listed one that is gone). A new piece of state belongs first in an object a program or a model owns,
so that it goes with it; what cannot goes here, with its owner and its lifetime.

The registries that serve one compile live here, each entry owned by the compile that made it:
``CONVERSIONS`` (below).
"""

from __future__ import annotations

import threading
from typing import Any

# marker key -> (the autograd.Function's name, its plain arguments) for the ``dynashard::tp_conversion`` markers
# a rewrite in progress traces (comm.collectives.TracedConversions): each key names its rewrite, and goes when
# it ends
CONVERSIONS: dict[str, tuple[Any, ...]] = {}
TRACING = threading.local()  # .conversions: the TracedConversions of this thread's rewrite in progress
# .source: the checkpoint or rank 0's deal of this thread's dynashard.parallelize example run in progress (None
# when it reads nothing); set while that run calls the model (dynamo_backend.parallelizing)
PARALLELIZING = threading.local()
# .on: this thread runs PEFT's merge (or unmerge) of a parallelized model's LoRA layers, whose parameters then read
# as this rank's shards (load.adapters); set while that merge runs
MERGING = threading.local()

STATE: dict[str, str] = {
    "dynashard.comm.protocol._HOSTS":
        "a user's group -> its host-side group; weak keys: gone with the group",
    "dynashard.comm.protocol._SEQUENCE":
        "(group name, agreement point) -> calls so far; one int per point, for the process",
    "dynashard.comm.protocol._HANDSHAKE_FAILURES":
        "handshakes failed so far (the same count on every rank); for the process",
    "dynashard.runtime.regions._REGIONS":
        "graph key -> the first program compiled for it (a weakref); a dead one's entry dropped at the next compile",
    "dynashard._torch.regions._GENERATION":
        "how many torch._dynamo.reset()s dynashard has seen (a message of its own in Dynamo's warn_once set, which "
        "a reset clears); for the process",
    "dynashard.runtime.program._GLOO_GROUPS":
        "gloo groups compiled for (a WeakSet), read by the exit hook; each gone with its group",
    "dynashard.runtime.program._EXIT_HOOK":
        "whether the gloo exit hook is registered; set at the first gloo compile, for the process",
    "dynashard.runtime.uncompiled_calls._HOOK":
        "the module registration hook's handle; set as the backend imports, for the process",
    "dynashard.runtime.compile_cache._DIGEST":
        "the digest of dynashard's source (the compile cache's keys); set at the first lookup, for the process",
    "dynashard.runtime.gate._OPEN":
        "slot -> the handshake of a program call in flight; popped when the call returns",
    "dynashard.runtime.gate._SLOTS":
        "the next gate slot (a counter, one per gated graph); for the process",
    "dynashard.report.progress._SEEN_PLANS":
        "digests of the plans whose table was logged at INFO; for the process",
    "dynashard.report.progress._LOCAL":
        "the compile in progress on this thread; set while it runs",
    "dynashard.weights.store.STORE":
        "facade and shard tables, all weakly keyed; each entry gone with its tensor",
    "dynashard.weights.freed._SAVE_REFUSAL":
        "whether the save tagger is registered; set on the first freed weight, for the process",
    "dynashard.training.optimizers.FREED":
        "freed weights alive (weakly) and the step hook's handle, held while one is alive",
    "dynashard.training.fsdp._LIVE":
        "STORE.live under a shorter name (the same table)",
    "dynashard.load.registered._SWAPPED":
        "module class -> its subclass holding shards; one per class, for the process",
    "dynashard._torch.dtensor._FOLLOWING":
        "the (gather, cut) that DCP's wrapped state-dict functions call; set by parallelize, for the process",
    "dynashard.plan.rules.registry.RULES":
        "op -> its layout rule; filled by @rule as plan.rules imports",
    "dynashard.plan.rules.registry.TAG_RULES":
        "torch.Tag -> its layout rule; filled by @rule as plan.rules imports",
    "dynashard.state.CONVERSIONS":
        "marker key -> conversion while a rewrite traces; its keys removed when that rewrite ends (the graph "
        "then calls each conversion itself, and goes with the program)",
    "dynashard.state.TRACING":
        "this thread's rewrite in progress (comm.collectives.TracedConversions); set while it traces",
    "dynashard.state.PARALLELIZING":
        "this thread's dynashard.parallelize example run (its loader); set while that run calls the model",
    "dynashard.state.MERGING":
        "this thread runs PEFT's merge of a parallelized model's LoRA layers; set while that merge runs",
}

HOOKS: dict[str, str] = {
    "dynashard.weights.freed: register_package":
        "a torch.serialization tagger refusing freed storages; from the first freed weight on",
    "dynashard.training.optimizers: register_optimizer_step_pre_hook":
        "refuses a step over freed weights; registered while one is alive, removed with the last",
    "dynashard.load.parallelize: register_module_parameter_registration_hook":
        "empty_weights' meta parameters; inside the context, on its thread",
    "dynashard.runtime.uncompiled_calls: register_module_module_registration_hook":
        "notices an OptimizedModule wrapping a module; from the backend's import on",
    "dynashard.runtime.uncompiled_calls: never_a_frame_of_its_own":
        "the forward pre-hook is never a Dynamo frame of its own; for the process",
    "dynashard.weights.facades: never_a_frame":
        "a facade's eager answer is never a Dynamo frame of its own; for the process",
    "dynashard.load.registered: never_a_frame":
        "a facade property's getter is never a Dynamo frame of its own; for the process",
    "dynashard._torch: skip_code":
        "what never_a_frame and never_a_frame_of_its_own do (Dynamo's skip list); for the process",
    "dynashard.runtime.program: atexit.register":
        "the gloo exit grace; from the first gloo compile on",
    "dynashard._torch.dtensor: dsd._gather_state_dict =":
        "DCP's full state dicts gather placed tensors; from the first parallelize on",
    "dynashard._torch.dtensor: dsd._distribute_state_dict =":
        "DCP's set_* cut whole values into placed tensors; from the first parallelize on",
    "dynashard._torch.dtensor: dsd._broadcast_state_dict =":
        "the same, for the broadcast path; from the first parallelize on",
    "dynashard.load.registered: __class__ =":
        "a parallelized module's class swapped for one holding shards; the module's lifetime",
    "dynashard.weights.facades: __class__ =":
        "a freed tensor becomes a facade (and back when filled); the tensor's lifetime",
    "dynashard.comm.collectives: custom_op":
        "the op dynashard::tp_conversion; from import on",
    "dynashard.runtime.gate: custom_op":
        "the op dynashard::call_gate; from import on",
}

TABLES: frozenset[str] = frozenset({
    "dynashard.state.STATE", "dynashard.state.HOOKS", "dynashard.__all__", "dynashard.plan.rules.__all__",
    "dynashard.options.HF_STYLES", "dynashard.options.HF_NOT_LINEAR",
    "dynashard.capture.linear_forms._VIEWS", "dynashard.capture.linear_forms._LINEAR",
    "dynashard.comm.collectives._LAYOUT_OPS", "dynashard.comm.collectives._FUNCTIONS",
    "dynashard.comm.protocol._PHASE", "dynashard.comm.protocol._STAGE",
    "dynashard.load.checkpoint._SAFETENSORS_DTYPES",
    "dynashard.plan.rules.attention._ATTENTION", "dynashard.plan.rules.inplace.SIZE_ARG",
    "dynashard.plan.rules.origins._RECORDS", "dynashard.plan.rules.partial._LINEAR_IN_FIRST",
    "dynashard.plan.rules.partial._SCALED", "dynashard.plan.rules.partial._ALL_PARTIAL",
    "dynashard.plan.rules.partial._ZEROS", "dynashard.plan.rules.reductions._ALONG_ONE_DIM",
    "dynashard.plan.rules.views._DIM_MAPS", "dynashard.plan.rules.views._SEPARATES",
    "dynashard.report.table._RTOL", "dynashard.rewrite.argument_check.REEXPRESSED",
    "dynashard.training.gradients._NORMS", "dynashard.weights.facades._CONVERSIONS", "dynashard.weights.facades._EAGER",
})

# SPDX-License-Identifier: Apache-2.0
"""The one place the integration replaces model.forward, for the two things a hook cannot do:
answer a forward without running it, and run it from a CUDA graph.

  * generate()'s first step after kvpool_generate's prefill: that prefill's ONE forward already
    computed the logits of every row's last prompt token, which is exactly what generate()'s
    first step asks for; the override answers them and runs nothing (no Reserve either: the
    pre-hook skips the step). Installed by the prefill.
  * cuda_graphs=True: a decode step replayed from its batch size's graph (_graphs.graph_step).
    Installed by the cache when asked for graphs.

Any other call goes to the model's own forward. The override is an instance attribute with the
forward's signature (functools.wraps: generate() inspects it), removed by KvpoolCache.close(),
which puts back whatever instance attribute was there before (another wrapper) or none.
"""
import functools


class ForwardOverride:
    """model.forward replaced for one KvpoolCache while installed (borrowed model and cache)."""

    def __init__(self, model, cache):
        self._model, self._cache = model, cache
        self.original = None  # the model's forward while installed
        self._previous = None  # the instance attribute it replaced, if any

    def install(self):
        """Idempotent."""
        if self.original is not None:
            return
        model = self._model
        self.original = model.forward
        self._previous = model.__dict__.get("forward")

        def forward(*args, **kwargs):
            return self._call(*args, **kwargs)

        model.forward = functools.wraps(self.original)(forward)

    def remove(self):
        """Idempotent."""
        if self.original is None:
            return
        if self._previous is not None:
            self._model.forward = self._previous
        else:
            self._model.__dict__.pop("forward", None)  # the class's forward again
        self.original = self._previous = None

    def _call(self, *args, **kwargs):
        cache = self._cache
        if cache._first is not None and kwargs.get("past_key_values") is cache:
            logits, cache._first = cache._first, None  # computed by the prefill
            from transformers.modeling_outputs import CausalLMOutputWithPast

            return CausalLMOutputWithPast(logits=logits, past_key_values=cache)
        from ._graphs import graph_step

        out = graph_step(cache, args, kwargs)
        return out if out is not None else self.original(*args, **kwargs)

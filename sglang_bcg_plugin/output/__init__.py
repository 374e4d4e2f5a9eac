"""The output policy, the idea this package exists for: what a capture session hands out.

Read top-down, in the order a capture meets them:

- :mod:`.mode`: the three output modes (``off``, ``on``, ``released``) and their one resolver;
- :mod:`.plan`: :func:`~.plan.plan_session`, what a capture session fixes (mode, buffer source, guard, pool reserve)
  from the options and the few figures a forecast advises;
- :mod:`.state`: :class:`~.state.CaptureState`, the one capture core every backend shares;
- :mod:`.policy`: :class:`~.policy.OutputPolicy`, one buffer per leaf path per stream partition: ``reserve`` → ``place``
  → ``commit`` → ``hand_out``;
- :mod:`.trees`, :mod:`.scan`: output trees (flatten, unflatten, storages) and the bounded search for tensors inside
  plain values;
- :mod:`.released`, :mod:`.guard`: released outputs (non-owning aliases) and the stale-output guard;
- :mod:`.report`: :class:`~.report.MemoryReport`, what a session holds."""

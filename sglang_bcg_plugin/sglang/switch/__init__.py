"""Switching the output mode of a running server, by layer: :mod:`.routes` (the HTTP route in the
launcher), :mod:`.rpc` (SGLang's RPC to every TP rank), :mod:`.rank` (one rank's re-capture and
rollback). ``sglang-bcg doctor`` reads the targets' source (:mod:`..doctor`)."""

"""A C2SP tlog-witness (``python -m auditor witness``) and the wire format it shares with the log.

``protocol``: the add-checkpoint request body; ``state``: the witness's persisted latest checkpoint per
log; ``core``: the checks and the cosigning (HTTP-free); ``server``: the HTTP app; ``client``: what the
log uses to submit; ``cli``: the command.
"""

"""Speculative decoding: proposers that guess a row's next tokens without the target model
(service/engine/spec/proposer.py), and the acceptance rule that keeps what the target agrees with
(service/engine/spec/accept.py). The scheduler asks the proposer for each decode's draft; the
runner scores a row's last token and its draft in one forward (a verify row: 1 + k query tokens);
the engine keeps the accepted tokens and the one after them, and rolls the rest back."""

"""The two roles a rank can play: target (data -> frozen forward -> send) and drafter
(receive -> train -> checkpoint/export)."""

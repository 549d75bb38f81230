"""`launcher.regenerate`'s engines: HF `generate` here (hf.py) or OpenAI-compatible servers (served.py),
sharing the prompts, the part files answers are written to as they finish, and the merged output (parts.py)."""

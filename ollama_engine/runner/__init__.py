"""The runner: sequences, the input cache, batch formation and the streaming batch loop."""

"""Parent side: spawn a runner, watch its health, and lay out model layers across devices."""

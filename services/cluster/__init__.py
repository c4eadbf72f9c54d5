"""``spade cluster up|down|status``: the distributed system as processes on one machine, from one env file."""

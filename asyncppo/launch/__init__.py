"""Ray launch: placement plan, actors, runner."""

"""The ground every component shares: config models, net and metrics helpers, task sources, the job spec,
rewards, the tiny model, and the trajectory and checkpoint wire formats. Imports no component."""

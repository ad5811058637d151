"""The torch side of the model: the networks behind the runtime's graphs and arrays, for training and for
exporting what the runtime runs (needs torch, which only the trainer's environment has).

The runtime (model/, index/, service/) never imports this package at module level: it imports it inside a
function, only when a graph or an array it needs is missing and has to be made (and says how to install
torch when it is not there)."""

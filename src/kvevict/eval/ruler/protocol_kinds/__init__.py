"""The protocols of the RULER grid as objects: `base.Protocol` and one module per protocol, `registry.PROTOCOLS`."""

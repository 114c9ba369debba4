"""The Ray cluster-launcher YAML `rayfleet render` writes, built by :mod:`.pipeline` as a
pipeline of fragments over one frozen :class:`.options.RenderOptions`: one module per feature,
each keeping the sentences that go above its fields (docs/house.md, convention 3) as data
beside the fragment."""

"""What tests share: tiny models and the transformers oracle (helpers), servers on loopback
(serving), worker harnesses (decode_harness, disagg_driver, reliability_harness), network
namespaces (netns), a fake Ray (fake_ray), GGUF fixtures, wire taps and benchmark-script
loading. Test modules import from here, never from each other."""

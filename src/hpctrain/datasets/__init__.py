"""Data sets: readers of the published layouts (CIFAR-10, CelebAMask-HQ, image folders), the drawn stand-ins in those
layouts (`hpctrain synth`), and the small fixtures the tests and demos use. The engine that orders, shards and loads
any data set is `hpctrain.data`; this package only knows what particular data sets look like."""

package config

// NBDConfig is what NBD volumes may connect to. Its fields are filled in by the issue that adds the source.
type NBDConfig struct{}

func (c *Config) validateNBD() error { return nil }

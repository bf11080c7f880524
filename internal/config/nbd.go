package config

import (
	"fmt"
	"path/filepath"

	"github.com/mountplan/mountplan/internal/errdefs"
)

// NBDDefaultPort is the IANA port of NBD, used when an address has none.
const NBDDefaultPort = 10809

// NBDConfig is what NBD volumes may connect to.
//
//	nbd:
//	  allowedServers: ["10.0.0.0/8:10809", "nbd.example.org:*"]
//	  socketRoots: [/run/nbd]
//	  tls: {certFile: /etc/mountplan/nbd/tls.crt, keyFile: ..., caFile: ...}
type NBDConfig struct {
	// AllowedServers are the TCP servers volumes may name, as
	// EndpointRule entries. Empty: no TCP server is allowed.
	AllowedServers []string `json:"allowedServers,omitempty"`
	// SocketRoots are directories under which a volume may name a unix
	// socket as its address. Empty: no unix socket is allowed.
	SocketRoots []string `json:"socketRoots,omitempty"`
	// TLS, when set, lets volumes ask for TLS (attribute tls: "true") with
	// these files; Required makes every connection use it.
	TLS *NBDTLS `json:"tls,omitempty"`
	// TimeoutSeconds bounds the plugin's handshake with the server (a
	// probe, a connect) and is the kernel's I/O timeout. 0: 30.
	TimeoutSeconds int `json:"timeoutSeconds,omitempty"`
}

// NBDTLS names the files the plugin presents and trusts when it makes a
// TLS connection to an NBD server.
type NBDTLS struct {
	CertFile string `json:"certFile,omitempty"`
	KeyFile  string `json:"keyFile,omitempty"`
	CAFile   string `json:"caFile,omitempty"`
	// Required refuses plain connections.
	Required bool `json:"required,omitempty"`
}

// ServerRules returns the parsed AllowedServers.
func (n NBDConfig) ServerRules() ([]EndpointRule, error) {
	return ParseEndpointRules("nbd.allowedServers", n.AllowedServers)
}

func (c *Config) validateNBD() error {
	n := c.NBD
	if _, err := n.ServerRules(); err != nil {
		return err
	}
	if err := checkRoots("nbd.socketRoots", n.SocketRoots); err != nil {
		return err
	}
	if err := checkNotNegative("nbd.timeoutSeconds", n.TimeoutSeconds); err != nil {
		return err
	}
	if t := n.TLS; t != nil {
		if t.CAFile == "" {
			return fmt.Errorf("nbd.tls needs caFile to verify servers: %w", errdefs.ErrInvalidArgument)
		}
		if (t.CertFile == "") != (t.KeyFile == "") {
			return fmt.Errorf("nbd.tls: certFile and keyFile go together: %w", errdefs.ErrInvalidArgument)
		}
		for _, f := range []string{t.CertFile, t.KeyFile, t.CAFile} {
			if f != "" && !filepath.IsAbs(f) {
				return fmt.Errorf("nbd.tls: %q must be an absolute path: %w", f, errdefs.ErrInvalidArgument)
			}
		}
	}
	return nil
}

// checkNotNegative accepts a count of seconds of 0 (the default) or more.
func checkNotNegative(field string, v int) error {
	if v < 0 {
		return fmt.Errorf("%s must not be negative: %w", field, errdefs.ErrInvalidArgument)
	}
	return nil
}

// checkRoots accepts clean absolute directories other than /.
func checkRoots(field string, roots []string) error {
	for i, r := range roots {
		if !filepath.IsAbs(r) || filepath.Clean(r) != r || r == "/" {
			return fmt.Errorf("%s[%d] %q must be a clean absolute path other than /: %w", field, i, r, errdefs.ErrInvalidArgument)
		}
	}
	return nil
}

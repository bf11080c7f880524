package config

import (
	"errors"
	"os"
	"path/filepath"
	"testing"

	"github.com/mountplan/mountplan/internal/errdefs"
)

func TestEndpointRules(t *testing.T) {
	rules, err := ParseEndpointRules("x", []string{"10.0.0.0/8:10809", "192.0.2.7:*", "NBD.Example.org.:3260", "[fd00::/8]:3260"})
	if err != nil {
		t.Fatal(err)
	}
	for _, tc := range []struct {
		addr  string
		allow bool
	}{
		{"10.1.2.3:10809", true}, {"10.1.2.3:10810", false}, {"11.0.0.1:10809", false},
		{"192.0.2.7:1", true}, {"192.0.2.7", true}, {"nbd.example.org:3260", true}, {"nbd.example.org:3261", false},
		{"other.example.org:3260", false}, {"[fd00::5]:3260", true}, {"[::ffff:10.0.0.1]:10809", true},
	} {
		ep, err := ParseEndpoint(tc.addr, 3260)
		if err != nil {
			t.Fatalf("ParseEndpoint(%q): %v", tc.addr, err)
		}
		if err := AllowEndpoint(rules, ep, "x"); (err == nil) != tc.allow {
			t.Errorf("%s: allowed=%v, want %v (%v)", tc.addr, err == nil, tc.allow, err)
		}
	}
	for _, bad := range []string{"10.0.0.0/8", "host:port", "10.0.0.0/33:1", "a_b.example:1", "1.2.3.4:0"} {
		if _, err := ParseEndpointRules("x", []string{bad}); !errors.Is(err, errdefs.ErrInvalidArgument) {
			t.Errorf("rule %q accepted: %v", bad, err)
		}
	}
	for _, bad := range []string{"", "a b:1", "1.2.3.4:99999", "[fe80::1%eth0]:1"} {
		if _, err := ParseEndpoint(bad, 1); !errors.Is(err, errdefs.ErrInvalidArgument) {
			t.Errorf("address %q accepted: %v", bad, err)
		}
	}
}

func TestLoadNBDAndISCSI(t *testing.T) {
	dir := t.TempDir()
	write := func(body string) string {
		p := filepath.Join(dir, "c.yaml")
		if err := os.WriteFile(p, []byte(body), 0o600); err != nil {
			t.Fatal(err)
		}
		return p
	}
	c, err := Load(write("nbd:\n  allowedServers: [\"127.0.0.1:*\"]\n  socketRoots: [/run/nbd]\n  tls: {caFile: /etc/ca.pem}\niscsi:\n  allowedPortals: [\"192.0.2.0/24:3260\"]\n"))
	if err != nil {
		t.Fatal(err)
	}
	if len(c.NBD.AllowedServers) != 1 || c.NBD.TLS.CAFile != "/etc/ca.pem" || len(c.ISCSI.AllowedPortals) != 1 {
		t.Fatalf("config %+v", c)
	}
	for _, bad := range []string{
		"nbd:\n  allowedServers: [\"127.0.0.1\"]\n",
		"nbd:\n  socketRoots: [run/nbd]\n",
		"nbd:\n  tls: {certFile: /a.pem}\n",
		"nbd:\n  tls: {caFile: /ca.pem, certFile: /a.pem}\n",
		"iscsi:\n  allowedPortals: [\"*:3260\"]\n",
		"iscsi:\n  deviceTimeoutSeconds: -1\n",
		"iscsi:\n  chapPassword: x\n",
	} {
		if _, err := Load(write(bad)); err == nil {
			t.Errorf("config accepted:\n%s", bad)
		}
	}
}

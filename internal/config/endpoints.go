package config

import (
	"fmt"
	"net"
	"net/netip"
	"strconv"
	"strings"

	"github.com/mountplan/mountplan/internal/errdefs"
)

// EndpointRule is one entry of an allow list of network servers, written
// HOST:PORT where HOST is an IP address, a CIDR prefix or a DNS name (IPv6
// in brackets: "[fd00::/8]:3260") and PORT is a number or "*" for any.
//
// An IP address in a volume's attributes matches address and prefix
// rules; a DNS name matches only a rule that names it (compared without
// case), so a name is never resolved to decide what it may reach.
type EndpointRule struct {
	prefix netip.Prefix // valid for address and prefix rules
	name   string       // for DNS name rules, lower case, no trailing dot
	port   int          // 0: any
}

// ParseEndpointRules parses an allow list; field names the config key for
// errors.
func ParseEndpointRules(field string, entries []string) ([]EndpointRule, error) {
	rules := make([]EndpointRule, 0, len(entries))
	for i, e := range entries {
		r, err := parseEndpointRule(e)
		if err != nil {
			return nil, fmt.Errorf("%s[%d] %q: %w: %w", field, i, e, err, errdefs.ErrInvalidArgument)
		}
		rules = append(rules, r)
	}
	return rules, nil
}

func parseEndpointRule(e string) (EndpointRule, error) {
	host, port, err := net.SplitHostPort(e)
	if err != nil {
		return EndpointRule{}, fmt.Errorf("want HOST:PORT (PORT a number or *)")
	}
	var r EndpointRule
	if port != "*" {
		if r.port, err = parsePort(port); err != nil {
			return r, err
		}
	}
	switch {
	case strings.Contains(host, "/"):
		p, err := netip.ParsePrefix(host)
		if err != nil {
			return r, fmt.Errorf("bad CIDR prefix: %v", err)
		}
		r.prefix = p.Masked()
	default:
		if a, err := netip.ParseAddr(host); err == nil {
			r.prefix = netip.PrefixFrom(a.Unmap(), a.Unmap().BitLen())
			break
		}
		if !validDNSName(host) {
			return r, fmt.Errorf("%q is neither an IP address, a CIDR prefix nor a DNS name", host)
		}
		r.name = canonicalName(host)
	}
	return r, nil
}

func parsePort(s string) (int, error) {
	p, err := strconv.Atoi(s)
	if err != nil || p < 1 || p > 65535 {
		return 0, fmt.Errorf("port %q is not a number from 1 to 65535", s)
	}
	return p, nil
}

func canonicalName(h string) string { return strings.TrimSuffix(strings.ToLower(h), ".") }

func validDNSName(h string) bool {
	h = strings.TrimSuffix(h, ".")
	if h == "" || len(h) > 253 {
		return false
	}
	for _, label := range strings.Split(h, ".") {
		if label == "" || len(label) > 63 || strings.HasPrefix(label, "-") || strings.HasSuffix(label, "-") {
			return false
		}
		for _, c := range label {
			if !(c >= 'a' && c <= 'z' || c >= 'A' && c <= 'Z' || c >= '0' && c <= '9' || c == '-') {
				return false
			}
		}
	}
	return true
}

// Endpoint is a parsed HOST:PORT from a volume's attributes.
type Endpoint struct {
	Host string // an IP address (no brackets) or a lower-case DNS name
	Port int
}

// String gives HOST:PORT, with brackets around an IPv6 address.
func (e Endpoint) String() string { return net.JoinHostPort(e.Host, strconv.Itoa(e.Port)) }

// ParseEndpoint parses HOST[:PORT] from a volume's attributes; a missing
// port is defaultPort. Errors wrap errdefs.ErrInvalidArgument.
func ParseEndpoint(s string, defaultPort int) (Endpoint, error) {
	host, port := s, ""
	if h, p, err := net.SplitHostPort(s); err == nil {
		host, port = h, p
	} else if strings.Count(s, ":") > 1 && !strings.HasPrefix(s, "[") {
		host = s // a bare IPv6 address
	}
	host = strings.Trim(host, "[]")
	e := Endpoint{Port: defaultPort}
	if port != "" {
		p, err := parsePort(port)
		if err != nil {
			return e, fmt.Errorf("address %q: %w: %w", s, err, errdefs.ErrInvalidArgument)
		}
		e.Port = p
	}
	if a, err := netip.ParseAddr(host); err == nil {
		if a.Zone() != "" {
			return e, fmt.Errorf("address %q: zoned IPv6 addresses are not supported: %w", s, errdefs.ErrInvalidArgument)
		}
		e.Host = a.Unmap().String()
		return e, nil
	}
	if !validDNSName(host) {
		return e, fmt.Errorf("address %q: %q is neither an IP address nor a DNS name: %w", s, host, errdefs.ErrInvalidArgument)
	}
	e.Host = canonicalName(host)
	return e, nil
}

// AllowEndpoint reports whether e matches one of rules; the error, which
// wraps errdefs.ErrInvalidArgument, says what the admin allows.
func AllowEndpoint(rules []EndpointRule, e Endpoint, field string) error {
	a, ipErr := netip.ParseAddr(e.Host)
	for _, r := range rules {
		if r.port != 0 && r.port != e.Port {
			continue
		}
		if ipErr == nil && r.prefix.IsValid() && r.prefix.Contains(a) {
			return nil
		}
		if ipErr != nil && r.name != "" && r.name == e.Host {
			return nil
		}
	}
	if len(rules) == 0 {
		return fmt.Errorf("server %s is not allowed: the admin config's %s is empty: %w", e, field, errdefs.ErrInvalidArgument)
	}
	return fmt.Errorf("server %s is not allowed by the admin config's %s: %w", e, field, errdefs.ErrInvalidArgument)
}

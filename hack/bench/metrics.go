package main

import (
	"bufio"
	"context"
	"fmt"
	"io"
	"net"
	"net/http"
	"os/exec"
	"strconv"
	"strings"
	"time"
)

// The plugin's own Prometheus histograms (when it has --metrics-address)
// tell the time spent inside its handlers from the time a call takes at the
// client, and time its device steps.
const (
	rpcMetric  = "mountplan_rpc_duration_seconds"
	stepMetric = "mountplan_step_duration_seconds"
)

// hist is the sum and count of one histogram series.
type hist struct{ sum, count float64 }

// metricsAddress returns a free loopback address for --metrics-address, or
// "" when the plugin has no such flag.
func metricsAddress(plugin string) string {
	out, _ := exec.Command(plugin, "--help").CombinedOutput()
	if !strings.Contains(string(out), "-metrics-address") {
		return ""
	}
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return ""
	}
	defer l.Close()
	return l.Addr().String()
}

// scrape reads in's plugin's RPC and step histograms: keys are
// "rpc:<method>" (successful calls, method without its service) and
// "step:<step>".
func (b *bench) scrape(ctx context.Context, in *instance) (map[string]hist, error) {
	if in.metricsAddr == "" {
		return nil, fmt.Errorf("plugin serves no metrics")
	}
	ctx, cancel := context.WithTimeout(ctx, 5*time.Second)
	defer cancel()
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, "http://"+in.metricsAddr+"/metrics", nil)
	if err != nil {
		return nil, err
	}
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		return nil, err
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		return nil, fmt.Errorf("metrics: %s", resp.Status)
	}
	return parseHists(resp.Body)
}

func parseHists(r io.Reader) (map[string]hist, error) {
	out := map[string]hist{}
	sc := bufio.NewScanner(r)
	sc.Buffer(make([]byte, 64*1024), 1024*1024)
	for sc.Scan() {
		line := sc.Text()
		var prefix, labelKey string
		switch {
		case strings.HasPrefix(line, rpcMetric+"_sum{"), strings.HasPrefix(line, rpcMetric+"_count{"):
			prefix, labelKey = "rpc:", "method"
		case strings.HasPrefix(line, stepMetric+"_sum{"), strings.HasPrefix(line, stepMetric+"_count{"):
			prefix, labelKey = "step:", "step"
		default:
			continue
		}
		name, rest, _ := strings.Cut(line, "{")
		labels, value, ok := strings.Cut(rest, "} ")
		if !ok {
			continue
		}
		v, err := strconv.ParseFloat(strings.TrimSpace(value), 64)
		if err != nil {
			continue
		}
		l := parseLabels(labels)
		if prefix == "rpc:" && l["code"] != "OK" {
			continue
		}
		key := l[labelKey]
		if i := strings.LastIndexByte(key, '/'); i >= 0 {
			key = key[i+1:]
		}
		key = prefix + key
		h := out[key]
		if strings.HasSuffix(name, "_sum") {
			h.sum += v
		} else {
			h.count += v
		}
		out[key] = h
	}
	return out, sc.Err()
}

func parseLabels(s string) map[string]string {
	m := map[string]string{}
	for _, kv := range strings.Split(s, ",") {
		k, v, ok := strings.Cut(kv, "=")
		if ok {
			m[strings.TrimSpace(k)] = strings.Trim(v, `"`)
		}
	}
	return m
}

// meansBetween returns the mean of every series over the calls made
// between two scrapes.
func meansBetween(before, after map[string]hist) map[string]time.Duration {
	out := map[string]time.Duration{}
	for k, a := range after {
		b := before[k]
		if n := a.count - b.count; n > 0 {
			out[k] = time.Duration((a.sum - b.sum) / n * float64(time.Second))
		}
	}
	return out
}

package main

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"net/url"
	"strings"
	"time"

	"github.com/mountplan/mountplan/internal/volview"
)

// defaultPluginURL is the plugin's metrics address as the chart sets it
// (metrics.port), on this host.
const defaultPluginURL = "http://127.0.0.1:29654"

// runVolumes prints what is mounted where: the plugin's records of every
// volume and its consumers (/debug/volumes on its metrics port), each
// consumer checked against the kernel from here (this process should see
// the host's processes: the mounter's pod has hostPID). It reads only.
func runVolumes(ctx context.Context, args []string, out io.Writer) error {
	fs := newFlagSet("volumes")
	pluginURL := fs.String("plugin-url", defaultPluginURL, "the plugin's metrics address (its --metrics-address), whose /debug/volumes lists the volumes")
	format := fs.String("o", "table", "output: table or json")
	timeout := fs.Duration("timeout", 30*time.Second, "how long to wait for the plugin")
	if err := parse(fs, args); err != nil {
		return err
	}
	if *format != "table" && *format != "json" {
		return fmt.Errorf("-o %q: want table or json: %w", *format, errUsage)
	}
	ctx, cancel := context.WithTimeout(ctx, *timeout)
	defer cancel()
	r, err := fetchVolumes(ctx, *pluginURL)
	if err != nil {
		return err
	}
	volview.HostProc.Check(r)
	if *format == "json" {
		return volview.WriteJSON(out, r)
	}
	return volview.WriteTable(out, r)
}

// fetchVolumes gets the plugin's report from base/debug/volumes.
func fetchVolumes(ctx context.Context, base string) (*volview.Report, error) {
	u, err := url.Parse(strings.TrimSuffix(base, "/") + "/debug/volumes")
	if err != nil || (u.Scheme != "http" && u.Scheme != "https") || u.Host == "" {
		return nil, fmt.Errorf("--plugin-url %q: want http://host:port: %w", base, errUsage)
	}
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, u.String(), nil)
	if err != nil {
		return nil, err
	}
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		return nil, fmt.Errorf("asking the plugin for its volumes (is it running with --metrics-address, and is %s its address?): %w", base, err)
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		msg, _ := io.ReadAll(io.LimitReader(resp.Body, 512))
		return nil, fmt.Errorf("%s: %s: %s", u, resp.Status, strings.TrimSpace(string(msg)))
	}
	var r volview.Report
	if err := json.NewDecoder(io.LimitReader(resp.Body, 64<<20)).Decode(&r); err != nil {
		return nil, fmt.Errorf("%s: not a volume listing: %w", u, err)
	}
	return &r, nil
}

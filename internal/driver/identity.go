package driver

import (
	"context"
	"sync"
	"time"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"google.golang.org/protobuf/types/known/wrapperspb"
	"k8s.io/klog/v2"

	"github.com/mountplan/mountplan/internal/mounter"
)

func (d *Driver) GetPluginInfo(context.Context, *csi.GetPluginInfoRequest) (*csi.GetPluginInfoResponse, error) {
	return &csi.GetPluginInfoResponse{Name: d.opts.DriverName, VendorVersion: d.opts.Version}, nil
}

func (d *Driver) GetPluginCapabilities(context.Context, *csi.GetPluginCapabilitiesRequest) (*csi.GetPluginCapabilitiesResponse, error) {
	svc := func(t csi.PluginCapability_Service_Type) *csi.PluginCapability {
		return &csi.PluginCapability{Type: &csi.PluginCapability_Service_{Service: &csi.PluginCapability_Service{Type: t}}}
	}
	return &csi.GetPluginCapabilitiesResponse{Capabilities: []*csi.PluginCapability{
		svc(csi.PluginCapability_Service_CONTROLLER_SERVICE),
		svc(csi.PluginCapability_Service_VOLUME_ACCESSIBILITY_CONSTRAINTS),
		svc(csi.PluginCapability_Service_SNAPSHOT_ACCESSIBILITY_CONSTRAINTS),
		{Type: &csi.PluginCapability_VolumeExpansion_{VolumeExpansion: &csi.PluginCapability_VolumeExpansion{
			Type: csi.PluginCapability_VolumeExpansion_ONLINE}}},
	}}, nil
}

// Probe is ready once the startup reconcile has finished, the journal
// can still be written (a plugin that cannot record intents must not take
// new work) and the mounter answers, when it is another process (the
// chart's sidecar serve).
//
// A silent mounter makes Probe not ready, not an error: kubelet's
// livenessprobe (and the plugin's own /healthz) restart the plugin on an
// error, which does not bring a mounter back; the mounter's container has
// a liveness probe of its own for that (mountplan-sidecar probe).
func (d *Driver) Probe(ctx context.Context, _ *csi.ProbeRequest) (*csi.ProbeResponse, error) {
	ready := d.ready.Load()
	if ready {
		if err := d.records.CheckWritable(); err != nil {
			klog.FromContext(ctx).Error(err, "Journal not writable")
			return nil, err
		}
	}
	if p, ok := d.node.(mounter.Pinger); ok && ready {
		ready = d.mounterProbe.answers(ctx, p)
	}
	return &csi.ProbeResponse{Ready: wrapperspb.Bool(ready)}, nil
}

// mounterProbeFresh is how long an answer of the mounter stands for
// Probe: kubelet's livenessprobe and the registrar call it every few
// seconds, and each would otherwise be a call to the mounter.
const mounterProbeFresh = 5 * time.Second

// mounterProbeTimeout bounds one Ping: Probe must answer well within
// livenessprobe's own timeout.
const mounterProbeTimeout = time.Second

// mounterProbe keeps the mounter's last answer to Ping.
type mounterProbe struct {
	mu    sync.Mutex
	asked time.Time // zero: never
	err   error     // the last answer
	now   func() time.Time
}

// answers reports whether the mounter answered, asking it again only when
// the last answer is older than mounterProbeFresh. A change (silent, or
// answering again) is logged once, with the reason.
func (m *mounterProbe) answers(ctx context.Context, p mounter.Pinger) bool {
	m.mu.Lock()
	defer m.mu.Unlock()
	now := time.Now
	if m.now != nil {
		now = m.now
	}
	if !m.asked.IsZero() && now().Sub(m.asked) < mounterProbeFresh {
		return m.err == nil
	}
	pctx, cancel := context.WithTimeout(ctx, mounterProbeTimeout)
	err := p.Ping(pctx)
	cancel()
	first := m.asked.IsZero()
	switch {
	case err != nil && (first || m.err == nil):
		klog.FromContext(ctx).Error(err, "The mounter does not answer: Probe says not ready until it does")
	case err == nil && !first && m.err != nil:
		klog.FromContext(ctx).Info("The mounter answers again")
	}
	m.asked, m.err = now(), err
	return err == nil
}

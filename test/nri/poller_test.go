package nri_test

import (
	"fmt"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/moby/sys/mountinfo"

	"github.com/mountplan/mountplan/internal/nri/guard"
	"github.com/mountplan/mountplan/pkg/plan"
)

// hostPoller reads the host's mount table (this test process is in the
// host's mount namespace) every few milliseconds for the whole test and
// records every mount it sees under kubelet's directory. In NRI mode the
// only thing allowed there is the guard: a volume's filesystem (ext4, xfs,
// overlay, a FUSE daemon's mount, a loop device) must never appear.
type hostPoller struct {
	root    string
	stop    chan struct{}
	done    chan struct{}
	mu      sync.Mutex
	samples int
	seen    map[string]int // "fstype source at mountpoint" -> samples
	bad     []string
}

func startHostPoller(t testing.TB, root string) *hostPoller {
	p := &hostPoller{root: root, stop: make(chan struct{}), done: make(chan struct{}), seen: map[string]int{}}
	start := time.Now()
	go p.run()
	t.Cleanup(func() {
		close(p.stop)
		<-p.done
		p.mu.Lock()
		defer p.mu.Unlock()
		var seen []string
		for k, n := range p.seen {
			seen = append(seen, fmt.Sprintf("%s (%d samples)", k, n))
		}
		slices.Sort(seen)
		t.Logf("host mount table polled %d times over %v; mounts seen under %s: %s",
			p.samples, time.Since(start).Round(time.Millisecond), root, strings.Join(seen, "; "))
		if len(p.bad) > 0 {
			t.Errorf("a volume appeared in the host's mount namespace under kubelet's directory: %s", strings.Join(p.bad, "; "))
		}
	})
	return p
}

func (p *hostPoller) run() {
	defer close(p.done)
	tick := time.NewTicker(3 * time.Millisecond)
	defer tick.Stop()
	for {
		select {
		case <-p.stop:
			p.sample() // one last look
			return
		case <-tick.C:
			p.sample()
		}
	}
}

func (p *hostPoller) sample() {
	infos, err := mountinfo.GetMounts(func(i *mountinfo.Info) (bool, bool) {
		return !plan.Within(p.root, i.Mountpoint), false
	})
	p.mu.Lock()
	defer p.mu.Unlock()
	if err != nil {
		p.bad = append(p.bad, "reading mountinfo: "+err.Error())
		return
	}
	p.samples++
	for _, i := range infos {
		k := fmt.Sprintf("%s %s at %s", i.FSType, i.Source, i.Mountpoint)
		if p.seen[k] == 0 && i.FSType != guard.FSType && len(p.bad) < 20 {
			p.bad = append(p.bad, k)
		}
		p.seen[k]++
	}
}

// count returns how many samples have been taken.
func (p *hostPoller) count() int {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.samples
}

//go:build clustertest

package cluster

import (
	"errors"
	"io"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"time"
)

// podLogs keeps the logs of mountplan's pods (the node pod's containers
// and the mounter's) under <root>/logs/pods, as kubelet writes them under
// <root>/log/pods: kubelet removes a pod's logs with the pod (a rolling
// update, helm uninstall, the node's stop), and the logs of the plugin
// and the mounter before a kill or a rollout are what explains a failed
// flow. Copies are refreshed every few seconds and once more at the end.
type podLogs struct {
	from, to string
	done     chan struct{}
	wg       sync.WaitGroup
}

func keepPodLogs(c *Cluster) *podLogs {
	k := &podLogs{from: c.cfg.path("log", "pods"), to: c.cfg.path("logs", "pods"), done: make(chan struct{})}
	k.wg.Add(1)
	go func() {
		defer k.wg.Done()
		tick := time.NewTicker(3 * time.Second)
		defer tick.Stop()
		for {
			select {
			case <-k.done:
				return
			case <-tick.C:
				k.sync()
			}
		}
	}()
	return k
}

// stop copies once more and stops.
func (k *podLogs) stop() {
	close(k.done)
	k.wg.Wait()
	k.sync()
}

// sync copies every log file of a kube-system mountplan pod that grew
// since the last copy (pods' directories: <namespace>_<pod>_<uid>).
func (k *podLogs) sync() {
	dirs, _ := filepath.Glob(filepath.Join(k.from, "kube-system_mountplan-*"))
	for _, d := range dirs {
		_ = filepath.Walk(d, func(p string, fi os.FileInfo, err error) error {
			if err != nil || !fi.Mode().IsRegular() || !strings.HasSuffix(p, ".log") {
				return nil
			}
			rel, err := filepath.Rel(k.from, p)
			if err != nil {
				return nil
			}
			dst := filepath.Join(k.to, rel)
			if st, err := os.Stat(dst); err == nil && st.Size() >= fi.Size() {
				return nil
			}
			_ = copyFile(p, dst)
			return nil
		})
	}
}

func copyFile(src, dst string) error {
	in, err := os.Open(src)
	if err != nil {
		return err
	}
	defer in.Close()
	if err := os.MkdirAll(filepath.Dir(dst), 0o755); err != nil {
		return err
	}
	out, err := os.Create(dst)
	if err != nil {
		return err
	}
	_, err = io.Copy(out, in)
	return errors.Join(err, out.Close())
}

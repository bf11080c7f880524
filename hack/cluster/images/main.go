// Command images builds the container images of the cluster test (make
// test-cluster) without a registry or an image builder, as image archives
// for `ctr images import`:
//
//   - mountplan: the Dockerfile's runtime stage, read from the Dockerfile: a
//     Debian root with the packages it installs (mmdebstrap, cached by package
//     list), and the binaries its builder stage builds, with the same go build
//     flags, where its COPY puts them;
//   - external-provisioner, external-snapshotter, the pod sandbox (pause) and busybox, each one
//     static binary, under the names the chart and containerd use, so that
//     nothing is ever pulled.
//
// Usage: go run ./hack/cluster/images -out DIR -cache DIR -provisioner BIN -snapshotter BIN -tag TAG
package main

import (
	"archive/tar"
	"bytes"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"io"
	"os"
	"os/exec"
	"path"
	"path/filepath"
	"slices"
	"strings"
	"time"

	"sigs.k8s.io/yaml"

	"github.com/mountplan/mountplan/test/dockerfile"
)

func main() {
	out := flag.String("out", "", "directory for the image archives (required)")
	cache := flag.String("cache", "/var/cache/mountplan-tools/images", "where the Debian root is kept between runs")
	provisioner := flag.String("provisioner", "", "the csi-provisioner binary (required)")
	snapshotter := flag.String("snapshotter", "", "the csi-snapshotter binary (required)")
	tag := flag.String("tag", "test", "tag of the mountplan image (repository: the chart's image.plugin.repository)")
	flag.Parse()
	if *out == "" || *provisioner == "" || *snapshotter == "" {
		flag.Usage()
		os.Exit(2)
	}
	if err := run(*out, *cache, *provisioner, *snapshotter, *tag); err != nil {
		fmt.Fprintln(os.Stderr, "images:", err)
		os.Exit(1)
	}
}

func run(out, cache, provisioner, snapshotter, tag string) error {
	for _, d := range []string{out, cache} {
		if err := os.MkdirAll(d, 0o755); err != nil {
			return err
		}
	}
	values, err := chartValues()
	if err != nil {
		return err
	}
	start := time.Now()
	if err := mountplanImage(filepath.Join(out, "mountplan.tar"), cache, values.Image.Plugin.Repository+":"+tag); err != nil {
		return fmt.Errorf("mountplan image: %w", err)
	}
	fmt.Fprintf(os.Stderr, "images: mountplan in %v\n", time.Since(start).Round(time.Second))
	pause, err := goBuild("./hack/cluster/pause")
	if err != nil {
		return err
	}
	defer os.Remove(pause)
	busybox, err := exec.LookPath("busybox")
	if err != nil {
		return fmt.Errorf("busybox-static: %w", err)
	}
	applets, err := exec.Command(busybox, "--list").Output()
	if err != nil {
		return fmt.Errorf("busybox --list: %w", err)
	}
	single := []struct {
		file, name, bin, at string
		links               []string
	}{
		{"provisioner.tar", values.Image.Provisioner.Repository + ":" + values.Image.Provisioner.Tag, provisioner, "/csi-provisioner", nil},
		{"snapshotter.tar", values.Image.Snapshotter.Repository + ":" + values.Image.Snapshotter.Tag, snapshotter, "/csi-snapshotter", nil},
		{"pause.tar", pauseImage, pause, "/pause", nil},
		{"busybox.tar", BusyboxImage, busybox, "/bin/busybox", strings.Fields(string(applets))},
	}
	for _, s := range single {
		// /tmp: the test's pods write there.
		files := []file{{name: s.at, src: s.bin, mode: 0o755}, {name: "/tmp", dir: true, mode: 0o1777}}
		for _, l := range s.links {
			if l != "busybox" {
				files = append(files, file{name: "/bin/" + l, link: "busybox"})
			}
		}
		layer, err := layerOf(files)
		if err != nil {
			return err
		}
		defer os.Remove(layer)
		entry := []string{s.at}
		if s.links != nil {
			entry = nil
		}
		if err := writeArchive(filepath.Join(out, s.file), s.name, entry, layer); err != nil {
			return err
		}
	}
	return nil
}

// The names the cluster test's pods and containerd's sandbox use.
const (
	BusyboxImage = "mountplan.local/busybox:test"
	pauseImage   = "registry.k8s.io/pause:3.10.2"
)

type imageValue struct{ Repository, Tag string }

type values struct {
	Image struct {
		Plugin, Provisioner, Snapshotter imageValue
	}
}

func chartValues() (values, error) {
	var v values
	b, err := os.ReadFile("charts/mountplan/values.yaml")
	if err != nil {
		return v, err
	}
	return v, yaml.Unmarshal(b, &v)
}

// mountplanImage builds the Dockerfile's runtime stage.
func mountplanImage(archive, cache, name string) error {
	stages, err := dockerfile.Parse("Dockerfile")
	if err != nil {
		return err
	}
	final := stages[len(stages)-1]
	pkgs, _ := dockerfile.AptInstalls(final)
	if len(pkgs) == 0 {
		return errors.New("the Dockerfile's runtime stage installs no package")
	}
	root, err := debianRoot(cache, final.From, pkgs)
	if err != nil {
		return err
	}
	// The builder's go builds, into a temporary directory for its /out.
	tmp, err := os.MkdirTemp("", "mountplan-image-")
	if err != nil {
		return err
	}
	defer os.RemoveAll(tmp)
	built := map[string]string{} // the builder's output path → the file here
	for _, b := range dockerfile.GoBuilds(stages[:len(stages)-1]) {
		if b.Out == "" {
			return fmt.Errorf("the Dockerfile, line %d: go build without -o", b.Line)
		}
		local := filepath.Join(tmp, path.Base(b.Out))
		flags := slices.Clone(b.Flags)
		flags[slices.Index(flags, "-o")+1] = local
		flags = joinQuoted(flags)
		for i := range flags {
			flags[i] = os.Expand(flags[i], buildArg(stages))
		}
		cmd := exec.Command("go", append(append([]string{"build"}, flags...), b.Package)...)
		cmd.Env = append(os.Environ(), b.Env...)
		cmd.Stdout, cmd.Stderr = os.Stderr, os.Stderr
		if err := cmd.Run(); err != nil {
			return fmt.Errorf("the Dockerfile, line %d: go build %s: %w", b.Line, b.Package, err)
		}
		built[b.Out] = local
	}
	var files []file
	for dst, src := range dockerfile.Copies(final) {
		local, ok := built[src]
		if !ok {
			return fmt.Errorf("the runtime stage copies %s, which no go build of the Dockerfile makes", src)
		}
		files = append(files, file{name: dst, src: local, mode: 0o755})
	}
	layer, err := layerOf(files)
	if err != nil {
		return err
	}
	defer os.Remove(layer)
	return writeArchive(archive, name, dockerfile.Entrypoint(final), root, layer)
}

// joinQuoted puts back together the words of a quoted flag value the shell
// reader split ('-s -w' came as "-ldflags='-s", "-w'"; "-s -w -X ..."
// likewise).
func joinQuoted(words []string) []string {
	var out []string
	for i := 0; i < len(words); i++ {
		w := words[i]
		for _, q := range []string{"'", `"`} {
			if strings.Count(w, q)%2 == 1 {
				for i+1 < len(words) {
					i++
					w += " " + words[i]
					if strings.Contains(words[i], q) {
						break
					}
				}
			}
			w = strings.ReplaceAll(w, q, "")
		}
		out = append(out, w)
	}
	return out
}

// buildArg gives a ${VAR} of the Dockerfile's go builds the value docker
// build would: the environment's (as a --build-arg), else the default of
// its ARG (the version the binaries report, internal/version).
func buildArg(stages []dockerfile.Stage) func(string) string {
	defaults := map[string]string{}
	for _, s := range stages {
		for _, in := range s.Instrs {
			if in.Cmd == "ARG" {
				name, value, _ := strings.Cut(in.Args, "=")
				defaults[name] = value
			}
		}
	}
	return func(name string) string {
		if v, ok := os.LookupEnv(name); ok {
			return v
		}
		return defaults[name]
	}
}

// debianRoot returns a tarball of a Debian root with pkgs, built once per
// release and package list with mmdebstrap (about a minute).
func debianRoot(cache, from string, pkgs []string) (string, error) {
	release := "bookworm"
	if !strings.Contains(from, release) {
		return "", fmt.Errorf("the runtime stage is FROM %s: this builder knows Debian %s only", from, release)
	}
	pkgs = slices.Sorted(slices.Values(pkgs))
	sum := sha256.Sum256([]byte(release + " " + strings.Join(pkgs, " ")))
	tarball := filepath.Join(cache, "debian-"+release+"-"+hex.EncodeToString(sum[:6])+".tar")
	if _, err := os.Stat(tarball); err == nil {
		return tarball, nil
	}
	fmt.Fprintf(os.Stderr, "images: building a Debian %s root with %v\n", release, pkgs)
	cmd := exec.Command("mmdebstrap", "--quiet", "--format=tar", "--variant=minbase", "--include="+strings.Join(pkgs, ","),
		"--dpkgopt=path-exclude=/usr/share/doc/*", "--dpkgopt=path-exclude=/usr/share/man/*",
		"--dpkgopt=path-exclude=/usr/share/locale/*", release, tarball+".tmp",
		"deb http://deb.debian.org/debian "+release+" main",
		"deb http://deb.debian.org/debian "+release+"-updates main",
		"deb http://deb.debian.org/debian-security "+release+"-security main")
	cmd.Stdout, cmd.Stderr = os.Stderr, os.Stderr
	if err := cmd.Run(); err != nil {
		os.Remove(tarball + ".tmp")
		return "", fmt.Errorf("mmdebstrap: %w", err)
	}
	return tarball, os.Rename(tarball+".tmp", tarball)
}

func goBuild(pkg string) (string, error) {
	f, err := os.CreateTemp("", "pause-")
	if err != nil {
		return "", err
	}
	f.Close()
	cmd := exec.Command("go", "build", "-trimpath", "-ldflags=-s -w", "-o", f.Name(), pkg)
	cmd.Env = append(os.Environ(), "CGO_ENABLED=0")
	cmd.Stdout, cmd.Stderr = os.Stderr, os.Stderr
	return f.Name(), cmd.Run()
}

// file is one entry of a layer: a regular file copied from src, a symlink
// or a directory.
type file struct {
	name, src, link string
	dir             bool
	mode            int64
}

// layerOf writes a layer tarball holding files (and their parent
// directories) and returns its path.
func layerOf(files []file) (string, error) {
	f, err := os.CreateTemp("", "layer-*.tar")
	if err != nil {
		return "", err
	}
	defer f.Close()
	tw := tar.NewWriter(f)
	written := map[string]bool{} // directories
	mtime := time.Unix(0, 0)
	slices.SortFunc(files, func(a, b file) int { return strings.Compare(a.name, b.name) })
	for _, fl := range files {
		name := strings.TrimPrefix(fl.name, "/")
		for _, d := range parents(name, written) {
			if err := tw.WriteHeader(&tar.Header{Typeflag: tar.TypeDir, Name: d + "/", Mode: 0o755, ModTime: mtime}); err != nil {
				return "", err
			}
		}
		if fl.dir {
			written[name] = true
			if err := tw.WriteHeader(&tar.Header{Typeflag: tar.TypeDir, Name: name + "/", Mode: fl.mode, ModTime: mtime}); err != nil {
				return "", err
			}
			continue
		}
		if fl.link != "" {
			if err := tw.WriteHeader(&tar.Header{Typeflag: tar.TypeSymlink, Name: name, Linkname: fl.link, Mode: 0o777, ModTime: mtime}); err != nil {
				return "", err
			}
			continue
		}
		src, err := os.Open(fl.src)
		if err != nil {
			return "", err
		}
		fi, err := src.Stat()
		if err != nil {
			src.Close()
			return "", err
		}
		err = tw.WriteHeader(&tar.Header{Typeflag: tar.TypeReg, Name: name, Mode: fl.mode, Size: fi.Size(), ModTime: mtime})
		if err == nil {
			_, err = io.Copy(tw, src)
		}
		src.Close()
		if err != nil {
			return "", err
		}
	}
	return f.Name(), tw.Close()
}

// parents returns the directories of name not written yet, outermost first.
func parents(name string, written map[string]bool) []string {
	var ds []string
	for d := path.Dir(name); d != "."; d = path.Dir(d) {
		ds = append([]string{d}, ds...)
	}
	var out []string
	for _, d := range ds {
		if !written[d] {
			written[d] = true
			out = append(out, d)
		}
	}
	return out
}

// writeArchive writes a `docker save` archive of one image: the layer
// tarballs in order, a config with the entrypoint, and the image's name.
func writeArchive(archive, name string, entrypoint []string, layers ...string) error {
	f, err := os.Create(archive + ".tmp")
	if err != nil {
		return err
	}
	defer f.Close()
	tw := tar.NewWriter(f)
	var diffIDs, layerNames []string
	for i, l := range layers {
		sum, size, err := digestOf(l)
		if err != nil {
			return err
		}
		diffIDs = append(diffIDs, "sha256:"+sum)
		layerNames = append(layerNames, fmt.Sprintf("layer%d.tar", i))
		if err := copyInto(tw, layerNames[i], l, size); err != nil {
			return err
		}
	}
	config, err := json.Marshal(map[string]any{
		"architecture": "amd64", "os": "linux", "created": time.Unix(0, 0).UTC(),
		"config": map[string]any{"Env": []string{"PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"},
			"Entrypoint": entrypoint, "WorkingDir": "/"},
		"rootfs": map[string]any{"type": "layers", "diff_ids": diffIDs},
	})
	if err != nil {
		return err
	}
	manifest, err := json.Marshal([]map[string]any{{"Config": "config.json", "RepoTags": []string{name}, "Layers": layerNames}})
	if err != nil {
		return err
	}
	for n, b := range map[string][]byte{"config.json": config, "manifest.json": manifest} {
		if err := tw.WriteHeader(&tar.Header{Typeflag: tar.TypeReg, Name: n, Mode: 0o644, Size: int64(len(b)), ModTime: time.Unix(0, 0)}); err != nil {
			return err
		}
		if _, err := io.Copy(tw, bytes.NewReader(b)); err != nil {
			return err
		}
	}
	if err := tw.Close(); err != nil {
		return err
	}
	if err := f.Close(); err != nil {
		return err
	}
	return os.Rename(archive+".tmp", archive)
}

func digestOf(p string) (string, int64, error) {
	f, err := os.Open(p)
	if err != nil {
		return "", 0, err
	}
	defer f.Close()
	h := sha256.New()
	n, err := io.Copy(h, f)
	return hex.EncodeToString(h.Sum(nil)), n, err
}

func copyInto(tw *tar.Writer, name, src string, size int64) error {
	f, err := os.Open(src)
	if err != nil {
		return err
	}
	defer f.Close()
	if err := tw.WriteHeader(&tar.Header{Typeflag: tar.TypeReg, Name: name, Mode: 0o644, Size: size, ModTime: time.Unix(0, 0)}); err != nil {
		return err
	}
	_, err = io.Copy(tw, f)
	return err
}

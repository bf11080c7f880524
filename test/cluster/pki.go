//go:build clustertest

package cluster

import (
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/rsa"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/hex"
	"encoding/pem"
	"fmt"
	"math/big"
	"net"
	"os"
	"path/filepath"
	"time"
)

// Identities with a static token each (--token-auth-file): enough for a
// test cluster, and no client certificates to sign.
var identities = []struct{ name, user, groups string }{
	{"admin", "admin", "system:masters"},
	{"controller-manager", "system:kube-controller-manager", ""},
	{"scheduler", "system:kube-scheduler", ""},
}

// writePKI writes under dir: a CA, the API server's serving certificate
// (for the node address, the kubernetes Service address and localhost), the
// service account key pair, the token file, and a kubeconfig per identity
// and per node's kubelet (kubelet-<node>.kubeconfig).
func writePKI(dir string, nodes []string) error {
	if err := os.MkdirAll(dir, 0o700); err != nil {
		return err
	}
	caKey, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		return err
	}
	now := time.Now().Add(-time.Hour)
	ca := &x509.Certificate{
		SerialNumber: big.NewInt(1), Subject: pkix.Name{CommonName: "mountplan-cluster-ca"},
		NotBefore: now, NotAfter: now.Add(10 * 24 * time.Hour),
		IsCA: true, BasicConstraintsValid: true, KeyUsage: x509.KeyUsageCertSign | x509.KeyUsageDigitalSignature,
	}
	caDER, err := x509.CreateCertificate(rand.Reader, ca, ca, &caKey.PublicKey, caKey)
	if err != nil {
		return err
	}
	srvKey, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		return err
	}
	srv := &x509.Certificate{
		SerialNumber: big.NewInt(2), Subject: pkix.Name{CommonName: "kube-apiserver"},
		NotBefore: now, NotAfter: now.Add(10 * 24 * time.Hour),
		KeyUsage:    x509.KeyUsageDigitalSignature | x509.KeyUsageKeyEncipherment,
		ExtKeyUsage: []x509.ExtKeyUsage{x509.ExtKeyUsageServerAuth},
		DNSNames:    []string{"localhost", "kubernetes", "kubernetes.default", "kubernetes.default.svc", "kubernetes.default.svc.cluster.local"},
		IPAddresses: []net.IP{net.ParseIP(nodeIP), net.ParseIP(serviceIP), net.ParseIP("127.0.0.1")},
	}
	caCert, err := x509.ParseCertificate(caDER)
	if err != nil {
		return err
	}
	srvDER, err := x509.CreateCertificate(rand.Reader, srv, caCert, &srvKey.PublicKey, caKey)
	if err != nil {
		return err
	}
	saKey, err := rsa.GenerateKey(rand.Reader, 2048)
	if err != nil {
		return err
	}
	files := map[string][]byte{
		"ca.crt":        pemBlock("CERTIFICATE", caDER),
		"apiserver.crt": pemBlock("CERTIFICATE", srvDER),
		"sa.key":        pemBlock("RSA PRIVATE KEY", x509.MarshalPKCS1PrivateKey(saKey)),
	}
	if files["apiserver.key"], err = ecKeyPEM(srvKey); err != nil {
		return err
	}
	pub, err := x509.MarshalPKIXPublicKey(&saKey.PublicKey)
	if err != nil {
		return err
	}
	files["sa.pub"] = pemBlock("PUBLIC KEY", pub)
	var tokens []byte
	ids := identities
	for _, n := range nodes {
		ids = append(ids, struct{ name, user, groups string }{"kubelet-" + n, "system:node:" + n, "system:nodes"})
	}
	for _, id := range ids {
		b := make([]byte, 16)
		if _, err := rand.Read(b); err != nil {
			return err
		}
		token := hex.EncodeToString(b)
		tokens = fmt.Appendf(tokens, "%s,%s,%s,%q\n", token, id.user, id.user, id.groups)
		files[id.name+".kubeconfig"] = kubeconfig(filepath.Join(dir, "ca.crt"), token)
	}
	files["tokens.csv"] = tokens
	for name, data := range files {
		if err := os.WriteFile(filepath.Join(dir, name), data, 0o600); err != nil {
			return err
		}
	}
	return nil
}

func pemBlock(typ string, der []byte) []byte {
	return pem.EncodeToMemory(&pem.Block{Type: typ, Bytes: der})
}

func ecKeyPEM(k *ecdsa.PrivateKey) ([]byte, error) {
	der, err := x509.MarshalECPrivateKey(k)
	if err != nil {
		return nil, err
	}
	return pemBlock("EC PRIVATE KEY", der), nil
}

func kubeconfig(caFile, token string) []byte {
	return fmt.Appendf(nil, `apiVersion: v1
kind: Config
clusters:
- name: mountplan
  cluster: {server: "https://%s:443", certificate-authority: %q}
users:
- name: user
  user: {token: %q}
contexts:
- name: mountplan
  context: {cluster: mountplan, user: user}
current-context: mountplan
`, nodeIP, caFile, token)
}

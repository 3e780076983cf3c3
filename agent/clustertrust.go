package agent

import (
	"context"
	"crypto/tls"
	"crypto/x509"
	"errors"
	"fmt"
	"slices"
	"strings"
	"sync/atomic"
	"time"

	"go.uber.org/zap"
	certificatesv1 "k8s.io/api/certificates/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/fields"
	certificatesv1client "k8s.io/client-go/kubernetes/typed/certificates/v1"
	"k8s.io/utils/clock"

	"github.com/tokenbroker/tokenbroker/agent/config"
	"github.com/tokenbroker/tokenbroker/pki"
)

// maxTrustBundles bounds the ClusterTrustBundles one read considers: a
// signer has one bundle per broker that publishes for it, a handful. A
// read asks for one more, so that exactly maxTrustBundles is not mistaken
// for too many.
const maxTrustBundles = 64

// trustGraceIntervals is how many intervals the CAs in service outlive
// failed reads (the API or the network failing, not an answer): past that
// the agent trusts no broker until a read succeeds, so that a CA an
// operator removed is not trusted for ever by an agent that cannot read.
const trustGraceIntervals = 10

// errNoTrustYet is what a broker client gets while no ClusterTrustBundle
// has given the agent a CA; the target backs off and tries again.
var errNoTrustYet = errors.New("no broker CA from ClusterTrustBundles yet")

// errNoTrust wraps why the agent trusts no broker after a read: the
// bundles hold nothing usable, or reads failed for longer than the grace.
var errNoTrust = errors.New("no broker is trusted")

// trustState is a set of broker CAs in service; never modified once stored.
// A state with err set trusts nothing: every broker is refused with err.
type trustState struct {
	pem  []byte
	pool *x509.CertPool
	// verify, if set, is a further check of every broker handshake: with
	// a pin, the chain must end at the pinned CA, the other CAs serving
	// only as intermediates, so that the pin's constraints (path length,
	// name constraints, validity) apply.
	verify func(tls.ConnectionState) error
	err    error
}

// clusterTrust keeps the broker CAs read from the signer-linked
// ClusterTrustBundles of the agent's cluster (identity.trustBundleFrom).
// The selection is by spec.signerName, checked again on every bundle read,
// because a bundle without a signer can be made by anyone allowed to create
// clustertrustbundles, while a signer-linked one needs attest on the signer.
//
// A read that the API answers is authoritative: if the bundles hold nothing
// usable (none, malformed, not the pin, too many), no broker is trusted
// until they do. A read that fails keeps the CAs in service for
// trustGraceIntervals intervals after the last good one, then drops them.
type clusterTrust struct {
	client   certificatesv1client.ClusterTrustBundleInterface
	signer   string
	selector string
	// pin, if set, keeps only the pinned CA and CAs that chain to it.
	pin      string
	interval time.Duration
	clock    clock.Clock
	log      *zap.Logger

	cur      atomic.Pointer[trustState]
	lastGood time.Time // of the last answered read; run's goroutine only
}

func newClusterTrust(src config.ClusterTrustBundleSource, pin string, c certificatesv1client.ClusterTrustBundleInterface, clk clock.Clock, log *zap.Logger) (*clusterTrust, error) {
	sel, err := metav1.LabelSelectorAsSelector(src.LabelSelector)
	if err != nil {
		return nil, fmt.Errorf("identity.trustBundleFrom.clusterTrustBundle.labelSelector: %w", err)
	}
	return &clusterTrust{client: c, signer: src.SignerName, selector: sel.String(), pin: pin,
		interval: time.Duration(src.Interval), clock: clk,
		log: log.With(zap.String("signer", src.SignerName))}, nil
}

// get is the CAs in service, nil before the first read.
func (t *clusterTrust) get() *trustState { return t.cur.Load() }

// run reads the bundles every interval until ctx is done.
func (t *clusterTrust) run(ctx context.Context) {
	for {
		timer := t.clock.NewTimer(t.interval)
		select {
		case <-ctx.Done():
			timer.Stop()
			return
		case <-timer.C():
		}
		if err := t.refresh(ctx); err != nil && ctx.Err() == nil {
			t.log.Error("reading the broker CAs from ClusterTrustBundles failed", zap.Error(err))
		}
	}
}

// refresh reads the bundles once and puts what they yield in service:
// their CAs, or, when the answer holds nothing usable, no trust at all
// (fail closed). When the API cannot be read, the CAs in service stay
// until trustGraceIntervals intervals have passed since the last answered
// read, and then no broker is trusted either. The error says why the read
// put no CA in service.
func (t *clusterTrust) refresh(ctx context.Context) error {
	now := t.clock.Now()
	list, err := t.client.List(ctx, metav1.ListOptions{
		FieldSelector: fields.OneTermEqualSelector("spec.signerName", t.signer).String(),
		LabelSelector: t.selector,
		Limit:         maxTrustBundles + 1,
	})
	if err != nil {
		err = fmt.Errorf("list ClusterTrustBundles of signer %s: %w", t.signer, err)
		prev := t.get()
		if prev == nil || prev.err != nil {
			return err
		}
		if grace := trustGraceIntervals * t.interval; now.Sub(t.lastGood) > grace {
			return t.distrust(fmt.Errorf("%w: no ClusterTrustBundle read succeeded for %s (more than %d intervals): %w",
				errNoTrust, now.Sub(t.lastGood).Round(time.Second), trustGraceIntervals, err))
		}
		return fmt.Errorf("%w; the CAs in service stay until %s", err, t.lastGood.Add(trustGraceIntervals*t.interval).UTC().Format(time.RFC3339))
	}
	t.lastGood = now
	if len(list.Items) > maxTrustBundles || list.Continue != "" {
		return t.distrust(fmt.Errorf("%w: more than %d ClusterTrustBundles of signer %s: narrow identity.trustBundleFrom.clusterTrustBundle.labelSelector",
			errNoTrust, maxTrustBundles, t.signer))
	}
	certs, err := selectTrust(list.Items, t.signer, t.pin, now, t.log)
	if err != nil {
		return t.distrust(fmt.Errorf("%w: %w", errNoTrust, err))
	}
	next, err := newTrustState(certs, t.pin)
	if err != nil {
		return t.distrust(fmt.Errorf("%w: %w", errNoTrust, err))
	}
	if prev := t.cur.Swap(next); prev == nil || prev.err != nil || string(prev.pem) != string(next.pem) {
		fps := make([]string, 0, len(certs))
		for _, c := range certs {
			fps = append(fps, pki.Fingerprint(c))
		}
		t.log.Info("broker CAs from ClusterTrustBundles in service", zap.Strings("cas", fps), zap.Int("bundles", len(list.Items)))
	}
	return nil
}

// distrust puts "no broker is trusted, because err" in service and
// returns err.
func (t *clusterTrust) distrust(err error) error {
	if prev := t.cur.Swap(&trustState{err: err}); prev == nil || prev.err == nil {
		t.log.Error("no broker is trusted until the ClusterTrustBundles of the signer yield a CA again", zap.Error(err))
	}
	return err
}

// newTrustState makes the state for the CAs selectTrust kept. With a pin,
// certs[0] is the pinned CA, the only root of the further check; the others
// (which chain to it) are intermediates there.
func newTrustState(certs []*x509.Certificate, pin string) (*trustState, error) {
	st := &trustState{pem: pki.EncodeCertificatesPEM(certs), pool: x509.NewCertPool()}
	for _, c := range certs {
		st.pool.AddCert(c)
	}
	if pin != "" {
		verify, err := pki.VerifyChainToPinned(certs[0], certs[1:])
		if err != nil {
			return nil, err
		}
		st.verify = verify
	}
	return st, nil
}

// selectTrust is the pure part of a read: of bundles (as listed, possibly
// holding anything), only those linked to signer and named as the API
// server requires for it count; their certificates are merged
// (pki.MergeCABundles, bundles in name order), then narrowed to the pin
// when one is set. Skipped bundles are logged by name. An empty result is
// an error.
func selectTrust(bundles []certificatesv1.ClusterTrustBundle, signer, pin string, now time.Time, log *zap.Logger) ([]*x509.Certificate, error) {
	prefix := strings.ReplaceAll(signer, "/", ":") + ":"
	var names []string
	var pems [][]byte
	sorted := slices.Clone(bundles)
	slices.SortFunc(sorted, func(a, b certificatesv1.ClusterTrustBundle) int { return strings.Compare(a.Name, b.Name) })
	for _, b := range sorted {
		// The field selector already chose these; a client that ignored
		// it (or a proxy) must still not make an unsigned bundle count.
		if b.Spec.SignerName != signer || !strings.HasPrefix(b.Name, prefix) {
			log.Warn("ignoring a ClusterTrustBundle of another signer", zap.String("bundle", b.Name), zap.String("bundle_signer", b.Spec.SignerName))
			continue
		}
		names = append(names, b.Name)
		pems = append(pems, []byte(b.Spec.TrustBundle))
	}
	certs, skipped, err := pki.MergeCABundles(pems)
	if err != nil {
		return nil, err
	}
	for _, s := range skipped {
		log.Warn("ignoring a ClusterTrustBundle that is not a bundle of CA certificates", zap.Error(s), zap.Strings("bundles", names))
	}
	if pin != "" && len(certs) > 0 {
		pinned, err := pki.PinnedCAs(certs, pin, now)
		if err != nil {
			return nil, fmt.Errorf("ClusterTrustBundles of signer %s: %w (identity.enroll.caFingerprint)", signer, err)
		}
		certs = pinned
	}
	if len(certs) == 0 {
		return nil, fmt.Errorf("no CA certificate in the ClusterTrustBundles of signer %s (%d found)", signer, len(names))
	}
	return certs, nil
}
